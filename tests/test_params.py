import numpy as np
import pytest

from p2ptrain.params import ALIGN_ELEMENTS, ParamSpace


def test_views_share_the_flat_buffer_and_are_aligned():
    space = ParamSpace([("a", (3, 5)), ("b", (7,)), ("c", (2, 2, 2))])
    flat = space.zeros()
    views = space.views(flat)
    views["b"][...] = 1.5
    assert flat[space.slot("b").offset : space.slot("b").offset + 7].tolist() == [1.5] * 7
    assert all(s.offset % ALIGN_ELEMENTS == 0 for s in space)
    assert space.size % ALIGN_ELEMENTS == 0
    assert space.n_params == 15 + 7 + 8
    for name, view in views.items():
        assert np.shares_memory(view, flat), name
        assert view.shape == space.slot(name).shape


def test_tensors_do_not_overlap():
    space = ParamSpace([(f"t{i}", (i + 1, 3)) for i in range(10)])
    flat = space.zeros()
    for i, s in enumerate(space):
        space.view(flat, s.name)[...] = i + 1
    for i, s in enumerate(space):
        assert (space.view(flat, s.name) == i + 1).all()
    assert flat.sum() == sum((i + 1) * (i + 1) * 3 for i in range(10))


def test_fingerprint_follows_layout_only():
    a = ParamSpace([("x", (4, 4)), ("y", (4,))])
    b = ParamSpace([("x", (4, 4)), ("y", (4,))])
    c = ParamSpace([("x", (4, 4)), ("y", (5,))])
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_bad_layouts_and_buffers_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        ParamSpace([("x", (1,)), ("x", (2,))])
    with pytest.raises(ValueError, match="non-positive"):
        ParamSpace([("x", (0, 2))])
    space = ParamSpace([("x", (4,))])
    with pytest.raises(ValueError, match="shape"):
        space.views(np.zeros(3, np.float32))
