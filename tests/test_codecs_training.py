"""Top-k 1% with error feedback trains an rwkv about as well as uncompressed gradients; top-k
0.1% without error feedback (the control) does not. Small model, a few minutes on 2 cores."""


import numpy as np
import pytest

from p2ptrain.codecs import ErrorFeedback, decode_message, encode_vector, make_codec
from p2ptrain.data import load_corpus
from p2ptrain.learner import Learner
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.settings import TrainConfig

STEPS, BATCH = 3000, 16
SENDER = bytes(range(16))


def train(codec_name: str | None, fraction: float = 0.0, error_feedback: bool = False) -> float:
    """Held-out loss after STEPS steps in which the gradient goes through the codec."""
    train_cfg = TrainConfig(lr=4e-3, warmup_samples=200, total_samples=STEPS * BATCH)
    model = RWKV(RWKVConfig(n_layer=1, n_embd=32, ctx_len=32))
    learner = Learner(model, "codec-test", train_cfg, load_corpus(None, 0.1, 40), BATCH, 1, 256)
    codec = make_codec(codec_name, fraction=fraction) if codec_name else None
    feedback = ErrorFeedback(codec, model.space.size) if codec and error_feedback else None
    for step in range(STEPS):
        loss = learner.compute_gradient()
        grad = learner.grad
        if codec is not None:
            args = {"sender_id": SENDER, "swarm_samples": learner.swarm_samples,
                    "weight": float(BATCH), "seed": step}
            messages = list(feedback.encode_vector(grad, **args) if feedback
                            else encode_vector(codec, grad, **args))
            grad.fill(0.0)
            for message in messages:
                decode_message(bytes(message), grad)
        learner.apply_gradient(grad, loss)
    assert np.isfinite(learner.params).all()
    return learner.evaluate()


@pytest.mark.slow
def test_topk_with_error_feedback_trains_like_uncompressed():
    plain = train(None)
    topk_ef = train("topk", 0.01, error_feedback=True)
    control = train("topk", 0.001, error_feedback=False)
    print(f"held-out loss: uncompressed {plain:.3f}, topk 1% + EF {topk_ef:.3f}, "
          f"topk 0.1% without EF {control:.3f}")
    assert plain <= 2.4
    assert topk_ef <= 1.05 * plain
    assert control > 1.05 * plain and control - topk_ef > 0.2
