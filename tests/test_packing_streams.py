"""StreamPool / capture_forked: branches forked from one stream and joined inside a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

from tunedb.runtime.streams import StreamPool


def test_pool_size_checked_before_cupy_is_touched():
    with pytest.raises(ValueError, match="at least one stream"):
        StreamPool(0, cp=object())


@pytest.mark.gpu
def test_forked_gemms_eager_and_captured_match_numpy():
    import cupy as cp

    from tunedb.runtime.streams import capture_forked

    rng = np.random.default_rng(0)
    shapes = [(64, 32, 48), (8, 128, 16), (33, 17, 65)]
    xs = [rng.standard_normal((m, k), dtype=np.float32) for m, n, k in shapes]
    ws = [rng.standard_normal((k, n), dtype=np.float32) for m, n, k in shapes]
    want = [x.astype(np.float64) @ w.astype(np.float64) for x, w in zip(xs, ws)]
    dx, dw = [cp.asarray(x) for x in xs], [cp.asarray(w) for w in ws]
    outs = [cp.zeros((m, n), dtype=cp.float32) for m, n, k in shapes]
    pool = StreamPool(len(shapes))
    main = cp.cuda.Stream(non_blocking=True)
    launches = [pool.blas(i).gemm(dx[i], dw[i], outs[i]) for i in range(len(shapes))]
    branches = [lambda i: launches[i]() for _ in shapes]
    assert capture_forked(main, branches, pool, capture=False) is None
    main.synchronize()
    for o, w in zip(outs, want):
        np.testing.assert_allclose(cp.asnumpy(o), w, rtol=1e-4, atol=1e-4)
    for o in outs:
        o.fill(0)
    cp.cuda.Device().synchronize()
    graph = capture_forked(main, branches, pool)
    for o in outs:  # nothing ran during the capture
        assert not bool(cp.any(o))
    graph.launch(main)
    main.synchronize()
    for o, w in zip(outs, want):
        np.testing.assert_allclose(cp.asnumpy(o), w, rtol=1e-4, atol=1e-4)
    pool.close()
