"""Reference decode: against float64 oracles, against a literal step-by-step transcription of the
scale-fused PV formula, absorption, masking and edge cases."""

import math

import pytest
import torch

import snapquant as sq
import snapquant.reference.decode as decode_module
from snapquant.quant.synthetic import synthetic_latent_rope, synthetic_queries

# Stated tolerances of reference vs the float64 oracle over the *same* dequantized cache and quantized
# query, i.e. the error of the decode arithmetic alone (blocked softmax + P precision):
#   P in bf16 (8-bit mantissa):   rel-L2 <= 6e-3
#   P in FP8 e4m3 (3-bit):        rel-L2 <= 4e-2 (fused), 8e-2 (naive, short contexts)
# LSE never sees P's rounding (l accumulates unrounded e): abs error <= 1e-4.
OUT_TOL = {"bf16": 6e-3, "fp8_scale_fused": 4e-2, "fp8_naive": 8e-2}
LSE_TOL = 1e-4
LENGTHS = [130, 1, 64, 65, 63]


def _case(seed: int, r: int = 128, d: int = 32, H: int = 8, T: int = 130):
    latent, rope = synthetic_latent_rope(T, r, d, batch=len(LENGTHS), seed=seed, rope_outlier_amplitude=30.0)
    q = synthetic_queries(latent, rope, H, seed=seed + 100)
    return latent, rope, q, torch.tensor(LENGTHS)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _prepare(name, latent, rope):
    cfg = sq.PRESETS[name]
    if cfg.nope_granularity == "per_token_block":
        cfg = cfg.replace(block_size=32)
    if "per_tensor_static" in (cfg.nope_granularity, cfg.rope_granularity):
        cfg = sq.calibrate(cfg, latent, rope)
    return cfg


@pytest.mark.parametrize("name", sorted(sq.PRESETS))
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_float64_oracle(name, seed):
    latent, rope, q, lengths = _case(seed)
    cfg = _prepare(name, latent, rope)
    kv = sq.quantize_kv(latent, rope, cfg)
    out, lse = sq.mla_decode_reference(q, kv, lengths)
    ref_out, ref_lse = sq.mla_decode_oracle(q, kv, lengths)
    assert out.shape == (5, 8, 128) and lse.shape == (5, 8)
    assert _rel(out, ref_out) <= OUT_TOL[cfg.pv], (name, _rel(out, ref_out))
    assert float((lse.double() - ref_lse).abs().max()) <= LSE_TOL


@pytest.mark.parametrize("name", ["snapmla", "snapmla_kv_only", "ds_v32", "bf16"])
def test_multi_token_queries_causal(name):
    """s_q = 2 (speculative verification): query i sees length - 1 + i tokens; equals two s_q = 1 calls."""
    latent, rope, _, lengths = _case(3)
    cfg = _prepare(name, latent, rope)
    kv = sq.quantize_kv(latent, rope, cfg)
    q2 = torch.randn(5, 2, 8, 160) * 0.3
    lengths = lengths.clamp_min(2)
    out, lse = sq.mla_decode_reference(q2, kv, lengths)
    for i in range(2):
        o1, l1 = sq.mla_decode_reference(q2[:, i], kv, lengths - 1 + i)
        torch.testing.assert_close(out[:, i], o1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, i], l1, rtol=1e-6, atol=1e-6)
    ref_out, _ = sq.mla_decode_oracle(q2, kv, lengths)
    assert _rel(out, ref_out) <= OUT_TOL[cfg.pv]


def test_unquantized_baseline_is_exact_attention():
    """bf16 preset with 16-bit rounding off = plain fp32 attention: the reference adds no error of its own."""
    latent, rope, q, lengths = _case(4)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["bf16"].replace(nope_dtype="fp16", rope_dtype="fp16"))
    lat16, rope16 = kv.dequantize()
    out, lse = sq.mla_decode_reference(q, kv, lengths, round_16bit=False)
    ex_out, ex_lse = sq.attention_fp64(q, lat16, rope16, lengths)
    assert _rel(out, ex_out) < 2e-6
    assert float((lse.double() - ex_lse).abs().max()) < 1e-5


def test_softmax_scale_is_used():
    latent, rope, q, lengths = _case(5)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla_kv_only"])
    out, _ = sq.mla_decode_reference(q, kv, lengths, softmax_scale=0.02)
    ref, _ = sq.mla_decode_oracle(q, kv, lengths, softmax_scale=0.02)
    other, _ = sq.mla_decode_oracle(q, kv, lengths)
    assert _rel(out, ref) < OUT_TOL["bf16"] < _rel(out, other)


# ------------------------------------------------------------------ scale-fused PV, step by step


U = 2.0**-24  # fp32 unit roundoff
LN2 = math.log(2.0)


def _e4m3(y: torch.Tensor) -> torch.Tensor:
    """e4m3 rounding of float64 values (through fp32: both steps are monotone, so intervals map to intervals)."""
    return y.float().clamp(-448, 448).to(torch.float8_e4m3fn).double()


def _literal_fused_decode(q_nope, q_rope, sigma, codes, s, rope_t, tau, L, ref_f_over_pi, ref_p, block=64):
    """numerics.md's SnapMLA decode for ONE head and ONE request, written out block by block with explicit
    Python state, independent of the vectorised reference. It runs in float64, so it is the formula itself
    (to ~1e-16) whatever order it sums in, and next to every quantity the fp32 reference computes it
    carries a first-order bound on the reference's error, from the standard model of fp32 arithmetic:
    every operation is off by at most U = 2^-24 relative; an n-term sum, in ANY order (the CPU kernels'
    order differs by ISA and thread count), by at most n U sum|terms|; exp2 / log2 by at most 1 ulp (2U).
      logit  x = coef s_j (<q^, c^_j> + <q~r, r~_j>): 80-term sum, then 3 roundings (x s_j, coef = fp32(tau
             log2 e) sigma, x coef): |dx_j| <= (80 + 5) U |coef| s_j (sum_k |q^_k c^_jk| + sum_i |q~r_i r~_ji|)
      max    |dm| <= max_j |dx_j| (a maximum moves by at most the largest move of its arguments)
      e      e_j = exp2(x_j - m): relative de_j <= ln2 (|dx_j| + |dm| + U |x_j - m|) + 2U
      pi     max_j f_j / 448, f_j = e_j s_j: relative dpi <= max_j f_j (de_j + U) / max_j f_j + U
      P      e4m3(f_j / pi), where f_j / pi carries dy_j = de_j + U + dpi + U: a rounding, so within dy_j of
             an e4m3 midpoint either neighbour is right. The reference's own f/pi and codes (ref_f_over_pi,
             ref_p) are checked against that band and the codes are then used here, so the output bound
             below needs no allowance for a code that legitimately went the other way.
      beta   exp2(m_old - m_new) pi_old / pi_new: ln2 (dm_old + dm_new + U |m_old - m_new|) + 2U + dpi_old
             + dpi_new + 2U
      acc    beta acc + P @ c: exact fp8 x fp8 products, an n-row sum (n U sum|P c|), 2 roundings
      l      beta l + sum_j e_j / pi: the e_j's own errors weighted by e_j, an n-term sum, pi's error
      out    acc / l;  lse = (m + log2(l pi)) ln2
    Returns (out, lse, bound on |out_ref - out|, bound on |lse_ref - lse|, the scale sum_j w_j |P_j c_j| / l
    that a fixed relative tolerance would have to be measured against)."""
    q, qr, c_all, s_all, r_all = (t.double() for t in (q_nope, q_rope, codes, s, rope_t))
    coef = tau * sigma * math.log2(math.e)
    n_dot = q.numel() + qr.numel()
    m_old, dm_old, pi_old, dpi_old = -math.inf, 0.0, 1.0, 0.0
    acc, acc_err, acc_abs = (torch.zeros(c_all.shape[-1], dtype=torch.float64) for _ in range(3))
    l_sum = l_err = 0.0
    for b, start in enumerate(range(0, L, block)):
        c, sj, r = c_all[start:min(start + block, L)], s_all[start:min(start + block, L)], r_all[start:min(start + block, L)]
        n = c.shape[0]
        x = coef * sj * (c @ q + r @ qr)
        dx = (n_dot + 5) * U * abs(coef) * sj * (c.abs() @ q.abs() + r.abs() @ qr.abs())
        m_new, dm_new = max(m_old, float(x.max())), max(dm_old, float(dx.max()))
        assert float((x - m_new).min()) > -100  # e stays a normal fp32 number: relative bounds apply
        e = torch.exp2(x - m_new)
        de = LN2 * (dx + dm_new + U * (x - m_new).abs()) + 2 * U
        f = e * sj
        pi_new = float(f.max()) / 448.0
        dpi_new = float((f * (de + U)).max()) / float(f.max()) + U
        y, dy = f / pi_new, de + U + dpi_new + U
        assert float(dy.max()) < 1e-2  # first order is enough (and the band stays far narrower than a code step)
        ref_y, p = ref_f_over_pi[b][:n].double(), ref_p[b][:n].double()
        assert ((ref_y - y).abs() <= dy * y).all(), "the reference's f / pi is off the formula"
        assert ((_e4m3(y * (1 - dy)) <= p) & (p <= _e4m3(y * (1 + dy)))).all(), "a P code no rounding of f / pi gives"
        if m_old == -math.inf:
            beta, dbeta = 0.0, 0.0
        else:
            beta = 2.0 ** (m_old - m_new) * pi_old / pi_new
            dbeta = LN2 * (dm_old + dm_new + U * abs(m_old - m_new)) + 2 * U + dpi_old + dpi_new + 2 * U
        pc_abs = p.abs() @ c.abs()
        acc_err = beta * acc_err + (dbeta + 2 * U) * beta * acc_abs + (n + 1) * U * pc_abs
        acc, acc_abs = beta * acc + p @ c, beta * acc_abs + pc_abs
        e_sum = float(e.sum())
        l_err = (beta * l_err + (dbeta + 2 * U) * beta * l_sum
                 + (float((e * de).sum()) + (n * U + dpi_new + 2 * U) * e_sum) / pi_new)
        l_sum = beta * l_sum + e_sum / pi_new
        m_old, dm_old, pi_old, dpi_old = m_new, dm_new, pi_new, dpi_new
    for b in range(len(range(0, L, block)), len(ref_p)):  # blocks past L are fully masked
        assert not ref_p[b].any()
    out = acc / l_sum
    out_err = acc_err / l_sum + out.abs() * (l_err / l_sum + U)
    log2_lpi = math.log2(l_sum * pi_old)
    lse = (m_old + log2_lpi) * LN2
    lse_err = (LN2 * dm_old + l_err / l_sum + dpi_old + U + 2 * U * LN2 * abs(log2_lpi)
               + U * LN2 * abs(m_old + log2_lpi) + U * abs(lse))
    slack = 1.01  # second-order terms: products of two relative errors, each < 1e-2
    return out, lse, slack * out_err, slack * lse_err, acc_abs / l_sum


class _RecordingFormat:
    """Stands in for the e4m3 format that mla_decode_reference rounds P with; keeps what it rounds."""

    def __init__(self, fmt):
        self.fmt, self.qmax, self.rounded = fmt, fmt.qmax, []

    def round_trip(self, x):
        out = self.fmt.round_trip(x)
        self.rounded.append((x.clone(), out.clone()))
        return out


@pytest.mark.parametrize("L", [1, 64, 100, 200])
def test_scale_fused_pv_matches_the_formula_step_by_step(L, monkeypatch):
    latent, rope = synthetic_latent_rope(200, 64, 16, seed=L)
    q = synthetic_queries(latent, rope, 4, seed=L + 1)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    p_fmt = _RecordingFormat(decode_module.get_element_format("fp8_e4m3"))
    real = decode_module.get_element_format
    monkeypatch.setattr(decode_module, "get_element_format", lambda name, *a: p_fmt if name == "fp8_e4m3" else real(name, *a))
    out, lse = sq.mla_decode_reference(q, kv, torch.tensor([L]))
    monkeypatch.undo()
    q_nope, q_rope, sigma = sq.quantize_query(q, sq.PRESETS["snapmla"], 64)
    codes, s, rope_t = kv.latent.codes_f32()[0], kv.latent.scale_f32()[0, :, 0], kv.rope.codes_f32()[0]
    tau = 1 / math.sqrt(80)
    for h in range(4):
        ref_f_over_pi = [x[0, 0, h, :, 0] for x, _ in p_fmt.rounded]  # [B, S, H, n, nb] per block
        ref_p = [p[0, 0, h, :, 0] for _, p in p_fmt.rounded]
        o_h, lse_h, o_err, lse_err, scale = _literal_fused_decode(
            q_nope[0, h], q_rope[0, h], float(sigma[0, h]), codes, s, rope_t, tau, L, ref_f_over_pi, ref_p)
        # the bound is the fp32 arithmetic's, far below what a wrong formula moves (fp8 P alone: ~1e-2)
        assert (o_err <= 5e-3 * scale).all() and lse_err < 5e-3
        assert ((out[0, h].double() - o_h).abs() <= o_err).all(), float(((out[0, h].double() - o_h).abs() / o_err).max())
        assert abs(float(lse[0, h]) - lse_h) <= lse_err


def test_naive_pv_is_worse_than_scale_fused_on_a_long_tail():
    """The paper's point: online-softmax P = exp(x - m) lies in (0, 1]; cast straight to FP8 at unit
    scale, the long tail of a peaked distribution (e ~ exp(-7) ~ 1e-3, below e4m3's smallest normal
    2^-6) lands on coarse subnormals or flushes to zero. Quantizing P per row per block after folding
    V's scale (SnapMLA) uses the whole e4m3 range for every block."""
    latent, rope = synthetic_latent_rope(2048, 64, 16, batch=2, seed=7, rope_outlier_amplitude=5.0)
    keys = torch.cat([latent, rope], dim=-1)
    tau = 1 / math.sqrt(80)
    # each head aims at token 0 so its logit sits ~7 above a long tail of 2047 others
    q = keys[:, :1].expand(2, 8, 80) * (7.0 / (tau * keys[:, :1].pow(2).sum(-1, keepdim=True)))
    q = q * (1 + 0.05 * torch.randn(2, 8, 1))
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    ref, _ = sq.mla_decode_oracle(q, kv)
    fused, _ = sq.mla_decode_reference(q, kv)
    naive, _ = sq.mla_decode_reference(q, kv, config=sq.PRESETS["snapmla_naive_pv"])
    assert _rel(fused, ref) < 0.02
    assert _rel(naive, ref) > 3 * _rel(fused, ref)


# ------------------------------------------------------------------ absorption


def test_absorbed_decode_equals_per_head_mla_attention():
    """Absorbing W_UK into q and applying W_UV after equals expanding K and V per head (float64)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, r, d, dn, dv = 2, 37, 4, 32, 8, 16, 12
    latent = torch.randn(B, T, r, generator=g, dtype=torch.float64)
    k_rot = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    q_nope = torch.randn(B, H, dn, generator=g, dtype=torch.float64)
    q_rot = torch.randn(B, H, d, generator=g, dtype=torch.float64)
    w = torch.randn(H * (dn + dv), r, generator=g, dtype=torch.float64) / math.sqrt(r)
    tau = 1 / math.sqrt(dn + d)

    w_uk, w_uv = sq.split_kv_b(w, H, dn, dv)
    out_lat, _ = sq.attention_fp64(sq.absorb_query(q_nope, q_rot, w_uk), latent, k_rot, softmax_scale=tau)
    absorbed = sq.project_output(out_lat, w_uv)

    kv = (latent @ w.T).view(B, T, H, dn + dv)
    k = torch.cat([kv[..., :dn], k_rot[:, :, None].expand(B, T, H, d)], dim=-1)
    v = kv[..., dn:]
    scores = torch.einsum("bhx,bthx->bht", torch.cat([q_nope, q_rot], -1), k) * tau
    naive = torch.einsum("bht,bthv->bhv", scores.softmax(-1), v)
    torch.testing.assert_close(absorbed, naive, rtol=1e-10, atol=1e-12)


def test_split_kv_b_rejects_wrong_shape():
    with pytest.raises(sq.ShapeError, match=r"kv_b_proj.weight must be \[H\*\(dn\+dv\)=112"):
        sq.split_kv_b(torch.randn(100, 32), 4, 16, 12)


# ------------------------------------------------------------------ edges and errors


def test_empty_request_gives_zero_output_and_minus_inf_lse():
    latent, rope = torch.randn(2, 10, 64), torch.randn(2, 10, 16)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    out, lse = sq.mla_decode_reference(torch.randn(2, 3, 80), kv, torch.tensor([0, 10]))
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize(
    "q_shape, lengths, match",
    [
        ((2, 3, 81), None, "kv_lora_rank 64 \\+ rope 16 = 80"),
        ((2, 80), None, "q must be"),
        ((3, 3, 80), None, "B=3"),
        ((2, 3, 80), [5], "lengths must have shape"),
        ((2, 3, 80), [5, 11], "lengths must lie in \\[0, 10\\]"),
    ],
)
def test_reference_rejects_bad_input(q_shape, lengths, match):
    kv = sq.quantize_kv(torch.randn(2, 10, 64), torch.randn(2, 10, 16), sq.PRESETS["snapmla"])
    with pytest.raises(sq.ShapeError, match=match):
        sq.mla_decode_reference(torch.randn(*q_shape), kv, None if lengths is None else torch.tensor(lengths))


def test_quantized_prefill_equals_step_by_step_decode_for_per_token_formats():
    """For per-token scales, all positions attending to the quantized cache at once (S = T, causal)
    gives what token-by-token decode over the growing cache gives."""
    latent, rope = synthetic_latent_rope(70, 64, 16, batch=1, seed=11)
    q = torch.randn(1, 70, 4, 80) * 0.3
    cfg = sq.PRESETS["snapmla"]
    kv = sq.quantize_kv(latent, rope, cfg)
    out_all, lse_all = sq.mla_decode_reference(q, kv, torch.tensor([70]))
    for t in (0, 1, 63, 64, 69):
        step = sq.quantize_kv(latent[:, : t + 1], rope[:, : t + 1], cfg)
        o, lse = sq.mla_decode_reference(q[:, t], step)
        torch.testing.assert_close(out_all[:, t], o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse_all[:, t], lse, rtol=1e-6, atol=1e-6)


def test_scale_fused_pv_stays_finite_when_later_blocks_peak_far_lower(monkeypatch):
    """A first block whose peak is ~120 log2-units above every later block (later e ~ 2^-120, still
    representable): beta = pi_old / pi_new would overflow fp32 without the pi floor (checked below by
    switching the floor off); the floor keeps acc finite and the result exact."""
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(1, 256, 64, generator=g)
    rope = torch.randn(1, 256, 16, generator=g)
    latent[0, :64] *= 8.0  # the first block's keys are much larger
    q = torch.cat([latent[:, 5], rope[:, 5]], dim=-1)[:, None].expand(1, 4, 80) * 0.19
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    out, lse = sq.mla_decode_reference(q, kv)
    ref, ref_lse = sq.mla_decode_oracle(q, kv)
    logits = torch.einsum("bhd,btd->bht", q.double(), torch.cat(kv.dequantize(torch.float64), -1)) / math.sqrt(80)
    gap = (logits[..., :64].amax(-1) - logits[..., 64:].amax(-1)) * math.log2(math.e)
    assert 100 < float(gap.min()) < 149  # later e lands in (2^-149, 2^-100): the overflow regime
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel(out, ref) < OUT_TOL["fp8_scale_fused"]
    assert float((lse.double() - ref_lse).abs().max()) <= LSE_TOL
    monkeypatch.setattr(decode_module, "PI_REL_FLOOR", 0.0)
    monkeypatch.setattr(decode_module, "PI_ABS_FLOOR", 0.0)
    unguarded, _ = sq.mla_decode_reference(q, kv)
    assert not torch.isfinite(unguarded).all()
