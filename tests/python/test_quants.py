"""quants.py: GGUF block layouts bit for bit, agreement with the gguf package, and error bounds per type."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from metalattn import quants  # noqa: E402

ALL_TYPES = [quants.F32, quants.F16, quants.BF16, quants.Q4_0, quants.Q4_1, quants.Q5_0, quants.Q5_1, quants.Q8_0]
QUANTIZED = [quants.Q4_0, quants.Q4_1, quants.Q5_0, quants.Q5_1, quants.Q8_0]


def random_matrix(seed, rows=64, cols=256):
    """Rows with very different scales and offsets, so every block has its own d (and m for Q4_1)."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(1e-3, 30.0, (rows, 1))
    offset = rng.uniform(-2.0, 2.0, (rows, 1)) * scale
    return (rng.standard_normal((rows, cols)) * scale + offset).astype(np.float32)


def edge_blocks():
    """One row per awkward block: zeros, constants, +/- magnitude ties, tiny (fp16-subnormal d) and huge values,
    values landing exactly on rounding boundaries of the quantizers."""
    rows = [np.zeros(32), np.full(32, 3.5), np.full(32, -0.25),
            np.r_[np.full(16, 1.0), np.full(16, -1.0)], np.r_[np.full(16, -1.0), np.full(16, 1.0)],
            np.linspace(-1e-6, 1e-6, 32), np.linspace(-3e4, 2e4, 32),
            np.r_[127.0, np.arange(31) + 0.5],          # Q8_0: d = 1, so q = x exactly on the .5 boundaries
            np.r_[-8.0, np.arange(31) * 0.5 - 7.25],     # Q4_0: d = 1, x*id + 8.5 on integer boundaries
            np.r_[0.0, 15.0, np.arange(30) * 0.5 + 0.25]]  # Q4_1: d = 1, (x-min)*id + 0.5 on boundaries
    return np.array(rows, dtype=np.float32)


def gguf_quantize(x, t):
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(t))
    return np.ascontiguousarray(ref).view(np.uint8).reshape(x.shape[0], -1)


@pytest.mark.parametrize("t", ALL_TYPES, ids=quants.type_name)
@pytest.mark.parametrize("which", ["random", "edges"])
def test_bit_exact_with_gguf_package(t, which):
    x = random_matrix(seed=t) if which == "random" else edge_blocks()
    ours = quants.quantize(x, t)
    assert ours.dtype == np.uint8 and ours.shape == (x.shape[0], quants.row_bytes(t, x.shape[1]))
    # The gguf package's quantizers claim ggml-reference bit-exactness; ours must produce identical bytes.
    np.testing.assert_array_equal(ours, gguf_quantize(x, t))
    theirs = np.asarray(gguf.quants.dequantize(ours, gguf.GGMLQuantizationType(t)), dtype=np.float32)
    mine = quants.dequantize(ours, t, *x.shape)
    assert mine.dtype == np.float32 and mine.shape == x.shape
    np.testing.assert_array_equal(mine.view(np.uint32), theirs.reshape(x.shape).view(np.uint32))


def _block_params(x, t):
    """Per-block (d, m) as stored (fp16-rounded), shaped to broadcast against [n_blocks, 32]."""
    q = quants.quantize(x, t).reshape(-1, quants.row_bytes(t, 32))
    d = q[:, :2].copy().view("<f2").astype(np.float32)
    m = q[:, 2:4].copy().view("<f2").astype(np.float32) if t in (quants.Q4_1, quants.Q5_1) else None
    return d, m


@pytest.mark.parametrize("t", ALL_TYPES, ids=quants.type_name)
def test_round_trip_error_bounds(t):
    x = random_matrix(seed=100 + t, rows=96, cols=512)
    y = quants.dequantize(quants.quantize(x, t), t, *x.shape)
    err = np.abs(y - x)
    if t == quants.F32:
        np.testing.assert_array_equal(y, x)
        return
    if t in (quants.F16, quants.BF16):
        mantissa_bits = 10 if t == quants.F16 else 7
        assert np.all(err <= np.abs(x) * 2.0 ** -(mantissa_bits + 1) + 1e-7)
        assert err.max() > 0  # it really rounded
        return
    blocks, err = x.reshape(-1, 32), err.reshape(-1, 32)
    d, m = _block_params(x, t)
    d = np.abs(d)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    fp16_rel = 2.0 ** -11  # relative rounding of the stored fp16 d and m
    if t == quants.Q8_0:
        bound = 0.5 * d + 127 * d * fp16_rel
    elif t in (quants.Q4_0, quants.Q5_0):
        # The largest-magnitude value sits on code 0; the other side tops out at code 15 (31), one step short of
        # +8 (+16).
        half_levels = 8 if t == quants.Q4_0 else 16
        bound = 1.0 * d + half_levels * d * fp16_rel
    else:
        levels = 15 if t == quants.Q4_1 else 31
        bound = 0.5 * d + levels * d * fp16_rel + np.abs(m) * fp16_rel
    assert np.all(err <= bound * (1 + 1e-5) + 1e-30)
    # And the bound is not vacuous: the error is a sizeable fraction of the step for these random blocks.
    assert np.median(err / np.maximum(d, 1e-30)) > 0.1
    assert np.all(d <= amax)


def test_q4_0_layout_by_hand():
    # d = 0.5 (fp16 0x3800), codes 0..15 then 15..0: weight j in the low nibble of byte j, j+16 in the high nibble.
    codes = np.r_[np.arange(16), np.arange(15, -1, -1)].astype(np.uint8)
    block = np.empty(18, np.uint8)
    block[:2] = [0x00, 0x38]
    block[2:] = codes[:16] | (codes[16:] << 4)
    w = quants.dequantize(block.reshape(1, 18), quants.Q4_0, 1, 32)
    np.testing.assert_array_equal(w[0], (codes.astype(np.float32) - 8) * 0.5)
    # Quantizing those weights back reproduces the block bytes exactly... except d: max magnitude is -4 at code 0,
    # so d = -4 / -8 = 0.5 again.
    np.testing.assert_array_equal(quants.quantize(w, quants.Q4_0)[0], block)


def test_q4_1_and_q8_0_layout_by_hand():
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 16, 32).astype(np.uint8)
    block = np.empty(20, np.uint8)
    block[:4] = np.array([0.25, -1.5], dtype="<f2").view(np.uint8)
    block[4:] = codes[:16] | (codes[16:] << 4)
    w = quants.dequantize(block.reshape(1, 20), quants.Q4_1, 1, 32)
    np.testing.assert_array_equal(w[0], codes.astype(np.float32) * 0.25 - 1.5)

    q8 = rng.integers(-127, 128, 32).astype(np.int8)
    block8 = np.empty(34, np.uint8)
    block8[:2] = np.array([0.125], dtype="<f2").view(np.uint8)
    block8[2:] = q8.view(np.uint8)
    w8 = quants.dequantize(block8.reshape(1, 34), quants.Q8_0, 1, 32)
    np.testing.assert_array_equal(w8[0], q8.astype(np.float32) * 0.125)


def test_multi_block_rows_keep_block_order():
    # Each block of a row gets a distinct magnitude: a block-order or row-order mix-up changes the result.
    rows, cols = 5, 32 * 6
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((rows, cols)) * np.repeat(np.arange(1, rows * 6 + 1).reshape(rows, 6), 32, axis=1))
    x = x.astype(np.float32)
    for t in QUANTIZED:
        y = quants.dequantize(quants.quantize(x, t), t, rows, cols)
        amax = np.abs(x.reshape(rows, 6, 32)).max(axis=2)
        assert np.all(np.abs(y - x).reshape(rows, 6, 32).max(axis=2) <= amax / 7 + 1e-6), quants.type_name(t)


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    x = np.array([[1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, np.nan, -np.inf, 3.0e38] + [0.5] * 27], dtype=np.float32)
    y = quants.dequantize(quants.quantize(x, quants.BF16), quants.BF16, 1, 32)
    assert y[0, 0] == 1.0                       # tie -> even (down)
    assert y[0, 1] == 1.0 + 4 * 2.0 ** -8       # tie -> even (up)
    assert np.isnan(y[0, 2]) and y[0, 3] == -np.inf
    assert np.isfinite(y[0, 4])


def test_argument_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.quantize(np.ones((2, 48), np.float32), quants.Q4_0)
    with pytest.raises(ValueError, match="needs 36 bytes"):
        quants.dequantize(np.zeros((2, 17), np.uint8), quants.Q4_0, 2, 32)
    with pytest.raises(ValueError, match="unsupported ggml type 20"):
        quants.quantize(np.ones((1, 32), np.float32), 20)  # IQ4_NL
    assert quants.parse_type("Q8_0") == quants.Q8_0 and quants.parse_type("bf16") == quants.BF16
    assert [quants.row_bytes(t, 64) for t in ALL_TYPES] == [256, 128, 128, 36, 40, 44, 48, 68]
    assert [quants.row_bytes(t, 512) for t in (quants.Q2_K, quants.Q3_K, quants.Q4_K, quants.Q5_K, quants.Q6_K)] == \
        [168, 220, 288, 352, 420]
    for name in ("q5_0", "Q5_1", "q2_k", "Q3_K", "q4_k", "Q5_K", "q6_k"):
        assert quants.type_name(quants.parse_type(name)) == name.upper()
        assert quants.parse_type(name) in quants.SUPPORTED_TYPES


def test_dequantize_accepts_the_readers_views():
    # A read-only, non-owning view (what load_gguf hands out) must work and must not be written to.
    x = random_matrix(seed=3, rows=8, cols=64)
    for t in ALL_TYPES:
        q = quants.quantize(x, t)
        buf = np.frombuffer(q.tobytes(), dtype=np.uint8).reshape(q.shape)
        assert not buf.flags.writeable
        np.testing.assert_array_equal(quants.dequantize(buf, t, 8, 64), quants.dequantize(q, t, 8, 64))


# ---------------------------------------------------------------- Q5_0, Q5_1 and the K-quants

NEW_TYPES = [quants.Q5_0, quants.Q5_1, quants.Q2_K, quants.Q3_K, quants.Q4_K, quants.Q5_K, quants.Q6_K]
# Relative L2 error of our quantizers on Gaussian rows (measured 0.043, 0.038, 0.080, 0.039, 0.020 at 512 columns).
ROUND_TRIP_REL_L2 = {quants.Q5_0: 0.05, quants.Q5_1: 0.05, quants.Q4_K: 0.10, quants.Q5_K: 0.05, quants.Q6_K: 0.03}


@pytest.mark.parametrize("t", NEW_TYPES, ids=quants.type_name)
def test_cpp_reference_dequantizer_is_bit_exact_with_gguf(t):
    # Random bytes are valid blocks of every type (scales included); the C++ reference (the scalar CPU path every
    # kernel is tested against) must produce the gguf package's values bit for bit, non-finite ones included.
    core = pytest.importorskip("metalattn._core")
    rng = np.random.default_rng(t)
    cols = 4 * quants.block_elems(t)
    raw = rng.integers(0, 256, (9, quants.row_bytes(t, cols)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t)).reshape(9, cols).astype(np.float32)
    got = core.dequantize(raw, t, cols)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    fin = np.isfinite(ref)
    assert np.array_equal(got[fin].view(np.uint32), ref[fin].view(np.uint32))
    np.testing.assert_array_equal(quants.dequantize(raw, t, 9, cols)[fin], ref[fin])


def random_blocks(t, rows, blocks_per_row, seed, finite_scales):
    """Random bytes (valid blocks of every type); with finite_scales the fp16 scale fields get ordinary values."""
    rng = np.random.default_rng(seed)
    cols = blocks_per_row * quants.block_elems(t)
    raw = rng.integers(0, 256, (rows * blocks_per_row, quants.row_bytes(t, quants.block_elems(t))), dtype=np.uint8)
    if finite_scales:
        fields = {quants.Q5_0: [0], quants.Q5_1: [0, 2], quants.Q2_K: [80, 82], quants.Q3_K: [108],
                  quants.Q4_K: [0, 2], quants.Q5_K: [0, 2], quants.Q6_K: [208]}[t]
        for off in fields:
            raw[:, off:off + 2] = _fp16_bytes_of(rng.uniform(-2.0, 2.0, raw.shape[0]))
    return raw.reshape(rows, -1), cols


def _fp16_bytes_of(v):
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


@pytest.mark.parametrize("t", NEW_TYPES, ids=quants.type_name)
@pytest.mark.parametrize("finite_scales", [True, False], ids=["finite", "raw"])
def test_numpy_dequantizer_is_bit_exact_with_gguf(t, finite_scales):
    # Our own numpy decoding of each layout against the gguf package's (an independent port of ggml's reference):
    # identical float32 bits wherever gguf's value is finite, identical non-finite positions elsewhere.
    raw, cols = random_blocks(t, rows=13, blocks_per_row=3, seed=100 + t, finite_scales=finite_scales)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t)), np.float32).reshape(13, cols)
    ours = quants.dequantize(raw, t, 13, cols)
    assert ours.dtype == np.float32 and ours.shape == (13, cols)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    fin = np.isfinite(ref)
    assert np.array_equal(ours[fin].view(np.uint32), ref[fin].view(np.uint32))
    if finite_scales:
        assert fin.all()


@pytest.mark.parametrize("t", [quants.Q5_0, quants.Q5_1, quants.Q4_K, quants.Q5_K, quants.Q6_K, quants.Q2_K,
                               quants.Q3_K], ids=quants.type_name)
def test_k_and_q5_layouts_by_hand(t):
    # One block built from known codes and scales, decoded by the formula in quant.h, element by element.
    rng = np.random.default_rng(5)
    if t in (quants.Q5_0, quants.Q5_1):
        codes = rng.integers(0, 32, 32).astype(np.uint8)
        qh = np.packbits(codes >> 4, bitorder="little")
        qs = (codes[:16] & 15) | ((codes[16:] & 15) << 4)
        if t == quants.Q5_0:
            block = np.concatenate([_fp16_bytes_of(np.array([0.5]))[0], qh, qs])
            expect = (codes.astype(np.float32) - 16) * 0.5
        else:
            block = np.concatenate([_fp16_bytes_of(np.array([0.25, -3.0])).reshape(-1), qh, qs])
            expect = codes.astype(np.float32) * 0.25 - 3.0
    elif t in (quants.Q4_K, quants.Q5_K):
        bits = 5 if t == quants.Q5_K else 4
        codes = rng.integers(0, 1 << bits, (8, 32)).astype(np.uint8)
        sc, mn = rng.integers(0, 64, 8).astype(np.uint8), rng.integers(0, 64, 8).astype(np.uint8)
        packed = np.empty(12, np.uint8)
        packed[0:4] = sc[0:4] | ((sc[4:8] >> 4) << 6)
        packed[4:8] = mn[0:4] | ((mn[4:8] >> 4) << 6)
        packed[8:12] = (sc[4:8] & 15) | ((mn[4:8] & 15) << 4)
        qs = np.concatenate([(codes[2 * c] & 15) | ((codes[2 * c + 1] & 15) << 4) for c in range(4)])
        head = np.concatenate([_fp16_bytes_of(np.array([0.125, 0.5])).reshape(-1), packed])
        if t == quants.Q5_K:
            qh = np.zeros(32, np.uint8)
            for j in range(8):
                qh |= ((codes[j] >> 4) & 1) << j
            block = np.concatenate([head, qh, qs])
        else:
            block = np.concatenate([head, qs])
        expect = ((np.float32(0.125) * sc[:, None].astype(np.float32)) * codes
                  - np.float32(0.5) * mn[:, None].astype(np.float32)).reshape(-1)
    elif t == quants.Q6_K:
        codes = rng.integers(0, 64, 256).astype(np.uint8)          # stored q; weight uses q - 32
        scales = rng.integers(-128, 128, 16).astype(np.int8)
        ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
        for i in range(256):
            h, f, l = i // 128, (i % 128) // 32, i % 32
            ql[64 * h + 32 * (f % 2) + l] |= (codes[i] & 15) << (4 * (f // 2))
            qh[32 * h + l] |= (codes[i] >> 4) << (2 * f)
        block = np.concatenate([ql, qh, scales.view(np.uint8), _fp16_bytes_of(np.array([0.25]))[0]])
        expect = (np.float32(0.25) * np.repeat(scales, 16).astype(np.float32)) * (codes.astype(np.float32) - 32)
    elif t == quants.Q3_K:
        q2 = rng.integers(0, 4, 256).astype(np.uint8)
        hbit = rng.integers(0, 2, 256).astype(np.uint8)
        sc6 = rng.integers(0, 64, 16).astype(np.uint8)              # stored scale; weight uses sc - 32
        hmask, qs, packed = np.zeros(32, np.uint8), np.zeros(64, np.uint8), np.zeros(12, np.uint8)
        for i in range(256):
            h, f, l = i // 128, (i % 128) // 32, i % 32
            qs[32 * h + l] |= q2[i] << (2 * f)
            hmask[l] |= hbit[i] << (4 * h + f)
        for s in range(16):
            packed[s % 8] |= (sc6[s] & 15) << (4 * (s // 8))
            packed[8 + s % 4] |= (sc6[s] >> 4) << (2 * (s // 4))
        block = np.concatenate([hmask, qs, packed, _fp16_bytes_of(np.array([0.5]))[0]])
        q = q2.astype(np.float32) - np.where(hbit == 1, 0, 4)
        expect = (np.float32(0.5) * (np.repeat(sc6, 16).astype(np.float32) - 32)) * q
    else:  # Q2_K
        q2 = rng.integers(0, 4, 256).astype(np.uint8)
        sc, mn = rng.integers(0, 16, 16).astype(np.uint8), rng.integers(0, 16, 16).astype(np.uint8)
        qs = np.zeros(64, np.uint8)
        for i in range(256):
            h, f, l = i // 128, (i % 128) // 32, i % 32
            qs[32 * h + l] |= q2[i] << (2 * f)
        block = np.concatenate([sc | (mn << 4), qs, _fp16_bytes_of(np.array([0.25, 0.125])).reshape(-1)])
        expect = ((np.float32(0.25) * np.repeat(sc, 16).astype(np.float32)) * q2
                  - np.float32(0.125) * np.repeat(mn, 16).astype(np.float32))
    assert block.size == quants.row_bytes(t, expect.size)
    got = quants.dequantize(block.reshape(1, -1), t, 1, expect.size)[0]
    np.testing.assert_array_equal(got, expect.astype(np.float32))


@pytest.mark.parametrize("t", list(ROUND_TRIP_REL_L2), ids=quants.type_name)
def test_new_type_round_trip(t):
    x = random_matrix(t, rows=32, cols=512)
    q = quants.quantize(x, t)
    assert q.shape == (32, quants.row_bytes(t, 512))
    y = quants.dequantize(q, t, 32, 512)
    rel = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert rel <= ROUND_TRIP_REL_L2[t], rel
    if t in (quants.Q5_0, quants.Q5_1):  # ggml's reference quantizer, through the gguf package
        np.testing.assert_array_equal(q, gguf_quantize(x, t))


def test_k_quant_rows_need_whole_super_blocks():
    assert quants.row_bytes(quants.Q4_K, 512) == 2 * 144 and quants.row_bytes(quants.Q6_K, 256) == 210
    assert quants.block_elems(quants.Q5_K) == 256 and quants.block_elems(quants.Q5_0) == 32
    with pytest.raises(ValueError, match="multiple of 256"):
        quants.row_bytes(quants.Q4_K, 640)
    with pytest.raises(ValueError, match="not supported"):
        quants.quantize(np.zeros((1, 256), np.float32), quants.Q2_K)
