"""Training data: the built-in corpus, user corpora, the held-out split and node shards."""

from p2ptrain.data.corpus import Corpus, DataError, load_corpus
from p2ptrain.data.sampler import Sampler, eval_windows

__all__ = ["Corpus", "DataError", "Sampler", "eval_windows", "load_corpus"]
