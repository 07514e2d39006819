"""gemm.grouped_dot: ``jax.lax.ragged_dot``'s products, each row times its own group's weights.

On CPU it is a C++ kernel (cuda/grouped_gemm_cpu.cc) whose every output element is one float32 sum
in ascending order of the reduction index, each product and sum rounded: the tests pin those bits
against a NumPy emulation of that order, the zeros (rows past the groups, empty groups' weight
gradients) exactly, and the values and gradients against ragged_dot to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import _native, fp8, gemm

ON_CPU_KERNEL = pytest.mark.skipif(not (_native.HAS_CPU and jax.default_backend() == "cpu"),
                                   reason="the CPU kernel runs where the native CPU module drives the default device")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _case(num_groups, num_rows, k, n, dtype, seed=0, spare_rows=3):
    """rows [M, K], weights [G, K, N], sizes [G] (an empty group, a large one, rows past the groups)."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(num_rows - spare_rows, np.ones(num_groups) / num_groups).astype(np.int32)
    if num_groups > 2:
        sizes[-1] += sizes[1]  # group 1 empty
        sizes[1] = 0
    rows = jnp.asarray(rng.standard_normal((num_rows, k)), dtype)
    weights = jnp.asarray(rng.standard_normal((num_groups, k, n)) / np.sqrt(k), dtype)
    return rows, weights, sizes


def _sequential(a, b_groups, sizes):
    """Per group g: a_g [M_g, R] @ b_groups[g] [R, N] as float32 sums over R in ascending order,
    each product and sum rounded to float32 (NumPy's float32 ufuncs round each op); zero rows past
    the groups."""
    a = np.asarray(a, np.float32)
    out = np.zeros((a.shape[0], b_groups[0].shape[1]), np.float32)
    start = 0
    for b, size in zip(b_groups, sizes):
        b = np.asarray(b, np.float32)
        acc = np.zeros((size, b.shape[1]), np.float32)
        for r in range(b.shape[0]):
            acc = acc + a[start:start + size, r:r + 1] * b[r]
        out[start:start + size] = acc
        start += size
    return out


# (G, M, K, N): one panel of each; and K, N and a group's rows past the kernel's panel depth (128),
# panel width (256) and row block (64), so its sums continue from panel to panel.
SHAPES = ((5, 29, 24, 40), (3, 200, 300, 280))


@ON_CPU_KERNEL
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("out_dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: "out-" + jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "G%d-M%d-K%d-N%d" % s)
def test_each_element_is_the_ascending_float32_sum(dtype, out_dtype, shape):
    rows, weights, sizes = _case(*shape, dtype)
    out = jax.jit(lambda r, w, s: gemm.grouped_dot(r, w, s, preferred_element_type=out_dtype))(
        rows, weights, jnp.asarray(sizes))
    assert out.dtype == out_dtype and out.shape == (shape[1], shape[3])
    want = _sequential(rows, list(weights), sizes).astype(out_dtype)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert not np.asarray(out[sizes.sum():], np.float32).any()  # rows past the groups
    assert np.asarray(out[:sizes.sum()], np.float32).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(4, 37, 16, 8), (8, 200, 64, 48), (1, 9, 1, 1), (3, 5, 33, 17)],
                         ids=lambda s: "G%d-M%d-K%d-N%d" % s)
def test_matches_ragged_dot(dtype, shape):
    rows, weights, sizes = _case(*shape, dtype, seed=1, spare_rows=min(3, shape[1] - 1))
    sizes = jnp.asarray(sizes)
    ours = jax.jit(lambda r, w, s: gemm.grouped_dot(r, w, s, preferred_element_type=jnp.float32))(rows, weights, sizes)
    theirs = jax.jit(lambda r, w, s: jax.lax.ragged_dot(r, w, s, preferred_element_type=jnp.float32))(
        rows, weights, sizes)
    # Both are float32 sums of the same exact products in different orders: K roundings apart at most.
    bound = shape[2] * np.finfo(np.float32).eps * jax.jit(
        lambda r, w, s: jax.lax.ragged_dot(jnp.abs(r), jnp.abs(w), s, preferred_element_type=jnp.float32))(
            rows.astype(jnp.float32), weights.astype(jnp.float32), sizes)
    assert np.all(np.abs(np.asarray(ours) - np.asarray(theirs)) <= np.asarray(bound) + 1e-30)
    # The default output dtype is the operands' (ragged_dot's rule).
    assert gemm.grouped_dot(rows, weights, sizes).dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_gradients_match_ragged_dots(dtype):
    rows, weights, sizes = _case(6, 45, 32, 24, dtype, seed=2)
    sizes = jnp.asarray(sizes)
    cot = jax.random.normal(jax.random.key(0), (45, 24), jnp.float32)

    def loss(dot):
        return lambda r, w: jnp.sum(dot(r, w, sizes, preferred_element_type=jnp.float32) * cot)

    got = jax.jit(jax.grad(loss(gemm.grouped_dot), argnums=(0, 1)))(rows, weights)
    want = jax.jit(jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1)))(rows, weights)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of the result
    for g, h in zip(got, want):
        assert g.dtype == h.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h, np.float32), rtol=tol, atol=tol)
    d_rows, d_weights = (np.asarray(g, np.float32) for g in got)
    assert not d_rows[int(sizes.sum()):].any()  # rows in no group get no gradient
    assert not d_weights[1].any() and d_weights[0].any()  # group 1 is empty


@ON_CPU_KERNEL
@pytest.mark.parametrize("shape", ((4, 23, 16, 24), (3, 330, 300, 140)), ids=lambda s: "G%d-M%d-K%d-N%d" % s)
def test_backward_kernels_sum_in_ascending_order(shape):
    """d rows = d out @ w[g]^T (the kernel reading the weights transposed) and d w[g] = rows_g^T @
    d out_g, each element one ascending float32 sum, bitwise (the second shape's groups hold over
    128 rows: the weight gradient's sums cross panels)."""
    num_groups, num_rows, k, n = shape
    rows, weights, sizes = _case(*shape, jnp.float32, seed=3)
    cot = jax.random.normal(jax.random.key(1), (num_rows, n), jnp.float32)
    d_rows, d_weights = jax.jit(jax.grad(
        lambda r, w: jnp.sum(gemm.grouped_dot(r, w, jnp.asarray(sizes)) * cot), argnums=(0, 1)))(rows, weights)
    np.testing.assert_array_equal(np.asarray(d_rows), _sequential(cot, [w.T for w in np.asarray(weights)], sizes))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for g in range(num_groups):
        segment = slice(starts[g], starts[g + 1])
        want = _sequential(np.asarray(rows)[segment].T, [np.asarray(cot)[segment]], [k])
        np.testing.assert_array_equal(np.asarray(d_weights[g]), want)


@ON_CPU_KERNEL
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_transposed_weights_are_the_swapped_product(dtype):
    """transpose_weights: weights [G, N, K] multiply as weights[g]^T, forward and gradients."""
    rows, weights, sizes = _case(5, 33, 24, 40, dtype, seed=5)
    sizes = jnp.asarray(sizes)
    weights_nk = jnp.swapaxes(weights, 1, 2)
    cot = jax.random.normal(jax.random.key(2), (33, 40), jnp.float32)

    def loss(r, w, transpose):
        out = gemm.grouped_dot(r, w, sizes, preferred_element_type=jnp.float32, transpose_weights=transpose)
        return jnp.sum(out * cot), out

    (_, got), (d_rows, d_nk) = jax.jit(jax.value_and_grad(lambda r, w: loss(r, w, True), argnums=(0, 1),
                                                          has_aux=True))(rows, weights_nk)
    (_, want), (e_rows, e_kn) = jax.jit(jax.value_and_grad(lambda r, w: loss(r, w, False), argnums=(0, 1),
                                                           has_aux=True))(rows, weights)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the same sums in the same order
    np.testing.assert_array_equal(np.asarray(d_rows, np.float32), np.asarray(e_rows, np.float32))
    np.testing.assert_array_equal(np.asarray(d_nk, np.float32), np.asarray(jnp.swapaxes(e_kn, 1, 2), np.float32))
    with pytest.raises(ValueError, match=r"weights \[G, N, K\] \(transpose_weights\)"):
        gemm.grouped_dot(rows, weights, sizes, transpose_weights=True)


@ON_CPU_KERNEL
def test_cpu_lowering_is_the_kernel_not_a_ragged_dot():
    rows, weights, sizes = _case(4, 16, 8, 8, jnp.bfloat16)
    text = jax.jit(lambda r, w, s: gemm.grouped_dot(r, w, s)).lower(rows, weights, jnp.asarray(sizes)).as_text()
    assert _native.GROUPED_DOT_TARGET in text and "ragged_dot" not in text
    grad_text = jax.jit(jax.grad(lambda r, w, s: jnp.sum(gemm.grouped_dot(r, w, s)).astype(jnp.float32),
                                 argnums=(0, 1))).lower(rows, weights, jnp.asarray(sizes)).as_text()
    assert _native.GROUPED_DOT_WEIGHT_GRAD_TARGET in grad_text and "ragged_dot" not in grad_text


def test_no_row_in_any_group_gives_zeros():
    rows, weights, _ = _case(3, 10, 8, 16, jnp.bfloat16)
    sizes = jnp.zeros((3,), jnp.int32)
    out = jax.jit(gemm.grouped_dot)(rows, weights, sizes)
    grads = jax.jit(jax.grad(lambda r, w: jnp.sum(gemm.grouped_dot(r, w, sizes).astype(jnp.float32) * 3),
                             argnums=(0, 1)))(rows, weights)
    for array in (out, *grads):
        assert not np.asarray(array, np.float32).any()


def test_rejects_bad_arguments():
    rows, weights, sizes = _case(3, 12, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"grouped_dot: rows, weights: expected rows \[M, K\] and weights \[G, K, N\]"):
        gemm.grouped_dot(rows[:, :4], weights, jnp.asarray(sizes))
    with pytest.raises(ValueError, match=r"grouped_dot: group_sizes: expected an integer array of shape \(3,\)"):
        gemm.grouped_dot(rows, weights, jnp.asarray(sizes[:2]))
    with pytest.raises(ValueError, match="grouped_dot: group_sizes: expected an integer array"):
        gemm.grouped_dot(rows, weights, jnp.asarray(sizes, jnp.float32))


# ---- FP8 weights read in place: gemm.fp8_gemm._dequantized_grouped_dot, the FP8 layers' CPU math ----------
# (G, M, K, N): K and N off the 128-wide scale blocks (partial blocks); and past the kernel's panels.
FP8_SHAPES = ((5, 29, 136, 200), (3, 200, 300, 280))


def _fp8_case(shape, dtype, seed=0):
    """rows [M, K] of dtype, FP8 weights [G, N, K] with their block scales, offsets [G + 1], sizes."""
    rows, weights, sizes = _case(*shape, jnp.float32, seed=seed)
    q, scale = fp8.quantize(jnp.swapaxes(weights, 1, 2))
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    return rows.astype(dtype), q, scale, offsets, sizes


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@ON_CPU_KERNEL
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "G%d-M%d-K%d-N%d" % s)
def test_fp8_weights_in_place_give_the_dequantised_bits(dtype, shape):
    """Forward: the NumPy emulation's bits (ascending float32 sums of the rows times q * scale, each
    a float32 product) and the dequantised copy's; the rows' gradient: the copy path's bits."""
    rows, q, scale, offsets, sizes = _fp8_case(shape, dtype)
    got = jax.jit(gemm.fp8_gemm._dequantized_grouped_dot)(rows, q, scale, offsets)
    block_scales = np.repeat(np.repeat(np.asarray(scale), 128, 1), 128, 2)[:, :q.shape[1], :q.shape[2]]
    deq = np.asarray(q, np.float32) * block_scales  # float32 products, as fp8.dequantize
    np.testing.assert_array_equal(_bits(got), _bits(_sequential(rows, [d.T for d in deq], sizes)))
    copy = jax.jit(gemm.fp8_gemm._xla_dequantized_grouped_dot)(rows, q, scale, offsets)  # the path the kernel replaced
    np.testing.assert_array_equal(_bits(got), _bits(copy))
    assert not np.asarray(got)[int(sizes.sum()):].any() and np.asarray(got).any()
    loss = lambda f: jax.jit(jax.grad(lambda r: jnp.sum(f(r, q, scale, offsets) ** 2)))(rows)
    d_kernel, d_copy = loss(gemm.fp8_gemm._dequantized_grouped_dot), loss(gemm.fp8_gemm._xla_dequantized_grouped_dot)
    assert d_kernel.dtype == rows.dtype and np.asarray(d_kernel, np.float32).any()
    np.testing.assert_array_equal(_bits(d_kernel), _bits(d_copy))


@ON_CPU_KERNEL
def test_fp8_weights_in_place_need_no_float32_copy():
    """The compiled forward and gradient hold no float32 copy of the experts (the copy path's temporaries
    are at least that), and lower to the FP8 kernel."""
    rows, q, scale, offsets, _ = _fp8_case((8, 80, 256, 512), jnp.float32)
    copy_bytes = q.size * 4
    for name, f in (("kernel", gemm.fp8_gemm._dequantized_grouped_dot), ("copy", gemm.fp8_gemm._xla_dequantized_grouped_dot)):
        for program in (f, jax.grad(lambda r, q, s, o, f=f: jnp.sum(f(r, q, s, o) ** 2))):
            lowered = jax.jit(program).lower(rows, q, scale, offsets)
            temp = lowered.compile().memory_analysis().temp_size_in_bytes
            if name == "kernel":
                assert _native.FP8_GROUPED_DOT_TARGET in lowered.as_text()
                assert temp < copy_bytes // 8, temp
            else:
                assert temp >= copy_bytes, temp
