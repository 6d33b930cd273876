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
def test_multi_token_queries_causal(name, monkeypatch):
    """s_q = 2 (speculative verification): query i sees length - 1 + i tokens, as two s_q = 1 calls do:
    every row of both is the formula over its visible tokens, within the fp32 bounds of _formula_decode
    (not equal to each other bit for bit: the kernels may sum an [S = 2] batch in another order)."""
    latent, rope, _, lengths = _case(3)
    cfg = _prepare(name, latent, rope)
    kv = sq.quantize_kv(latent, rope, cfg)
    q2 = torch.randn(5, 2, 8, 160) * 0.3
    lengths = lengths.clamp_min(2)
    out, _ = _decode_checked_against_formula(monkeypatch, q2, kv, lengths)
    for i in range(2):
        _decode_checked_against_formula(monkeypatch, q2[:, i], kv, lengths - 1 + i)
    ref_out, _ = sq.mla_decode_oracle(q2, kv, lengths)
    assert _rel(out, ref_out) <= OUT_TOL[cfg.pv]


def test_unquantized_baseline_is_exact_attention(monkeypatch):
    """bf16 preset with 16-bit rounding off = plain fp32 attention: the reference adds no error of its own
    beyond fp32 rounding (the formula check's bounds, with P = f unrounded), and the formula is
    attention_fp64's."""
    latent, rope, q, lengths = _case(4)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["bf16"].replace(nope_dtype="fp16", rope_dtype="fp16"))
    lat16, rope16 = kv.dequantize()
    out, lse = _decode_checked_against_formula(monkeypatch, q, kv, lengths, round_16bit=False)
    ex_out, ex_lse = sq.attention_fp64(q, lat16, rope16, lengths)
    # a loose cross-check of the formula itself: its bounds are <= 5e-3 of the magnitude scale
    assert _rel(out, ex_out) < 5e-3
    assert float((lse.double() - ex_lse).abs().max()) < 5e-3


def test_softmax_scale_is_used():
    latent, rope, q, lengths = _case(5)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla_kv_only"])
    out, _ = sq.mla_decode_reference(q, kv, lengths, softmax_scale=0.02)
    ref, _ = sq.mla_decode_oracle(q, kv, lengths, softmax_scale=0.02)
    other, _ = sq.mla_decode_oracle(q, kv, lengths)
    assert _rel(out, ref) < OUT_TOL["bf16"] < _rel(out, other)


# ------------------------------------------------------------------ the formula step by step, with fp32 error bounds


U = 2.0**-24  # fp32 unit roundoff
LN2 = math.log(2.0)
TINY = 2.0**-126  # fp32's smallest normal: what an exp2 kernel may flush to zero


def _round_to(fmt: str, y: torch.Tensor) -> torch.Tensor:
    """fp32 values -> the value `fmt` (e4m3 or bf16) rounds them to; monotone, so intervals map to intervals."""
    if fmt == "e4m3":
        return y.float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return y.float().to(torch.bfloat16).double()


def _formula_decode(q_nope, q_rope, sigma, codes, scales, rope, tau, L, *, pv, prescaled, ref_p=None, block=64):
    """docs/numerics.md's decode for ONE query row of ONE head over its L visible tokens, written out block by
    block with explicit Python state, independent of the vectorised reference. It runs in float64, so it is
    the formula itself (to ~1e-16) whatever order it sums in, and next to every quantity the fp32
    reference computes it carries a first-order bound on the reference's error, from the standard model
    of fp32 arithmetic: each operation is off by at most U = 2^-24 relative; an n-term sum, in ANY order
    (the CPU kernels' order differs by ISA, thread count and tensor shape), by at most n U sum|terms|;
    exp2 / log2 by at most 1 ulp (2U), and exp2 may flush results below 2^-126 to zero.
      logit  x_j = coef sum_k s_jk <q^_k, c^_jk> + RoPE  (coef = fp32(tau log2 e) sigma): r + d products,
             nb + 1 partial sums, <= 5 roundings: |dx_j| <= (r + d + nb + 5) U |coef| sum|products|
      max    |dm| <= max_j |dx_j|  (a maximum moves by at most the largest move of its arguments)
      e      exp2(x_j - m): |de_j| <= e_j (ln2 (|dx_j| + |dm| + U |x_j - m|) + 2U) + 2^-126
      P      from f_jk = e_j s_jk:  fp8_scale_fused  pi_k = max_j f_jk / 448 (its error: the largest f
             error / 448 + U pi), P = e4m3(f / pi);  bf16  P = bf16(f);  unrounded (round_16bit=False) P = f.
             A rounding whose input lies within its error band of a midpoint may go either way, so the
             reference's own P (ref_p: per block, (rounded inputs, codes) [n, nb]) is checked against the
             band and its codes used here: the output bound then needs no allowance for a legitimate tip.
      rescale  exp2(m_old - m_new) (times pi_old / pi_new when fused): ln2 (|dm_old| + |dm_new| +
             U |m_old - m_new|) + 2U, + the pi errors + 2U
      acc    rescale acc + P @ c^: exact products of codes, an n-row sum, 2 roundings
      l      rescale l + sum_j e_j (/ pi): the e_j's errors, an n-term sum, pi's error, 2 roundings
      out    acc / l;   lse = (m + log2(l pi)) ln2
    Returns (out [r], lse, bound on |out_ref - out| [r], bound on |lse_ref - lse|, the scale
    sum_j w_j |P_j| |c^_j| / l that a fixed relative tolerance would have to be measured against)."""
    q, qr, c_all, s_all, r_all = (t.double() for t in (q_nope, q_rope, codes, scales, rope))
    nb = s_all.shape[-1]
    bw = c_all.shape[-1] // nb
    fused, fmt = pv == "fp8_scale_fused", {"fp8_scale_fused": "e4m3", "bf16": "bf16"}.get(pv)
    assert pv in ("fp8_scale_fused", "bf16", "unrounded") and (nb == 1 or not prescaled)
    coef = tau * sigma * math.log2(math.e)
    dx_factor = (q.numel() + qr.numel() + nb + 5) * U * abs(coef)
    qb = q.view(nb, bw)
    m_old, dm_old = -math.inf, 0.0
    pi_old, api_old = torch.ones(nb, dtype=torch.float64), torch.zeros(nb, dtype=torch.float64)
    acc, acc_err, acc_abs = (torch.zeros(nb, bw, dtype=torch.float64) for _ in range(3))
    l_sum, l_err = torch.zeros(nb, dtype=torch.float64), torch.zeros(nb, dtype=torch.float64)
    for b, start in enumerate(range(0, L, block)):
        end = min(start + block, L)
        c, sj, r = c_all[start:end].view(-1, nb, bw), s_all[start:end], r_all[start:end]
        n = c.shape[0]
        dots, dots_abs = (c * qb).sum(-1), (c.abs() * qb.abs()).sum(-1)  # [n, nb]
        if prescaled:
            x = coef * sj[:, 0] * (dots[:, 0] + r @ qr)
            dx = dx_factor * sj[:, 0] * (dots_abs[:, 0] + r.abs() @ qr.abs())
        else:
            x = coef * ((sj * dots).sum(-1) + r @ qr)
            dx = dx_factor * ((sj * dots_abs).sum(-1) + r.abs() @ qr.abs())
        m_new, dm_new = max(m_old, float(x.max())), max(dm_old, float(dx.max()))
        e = torch.exp2(x - m_new)
        ae = e * (LN2 * (dx + dm_new + U * (x - m_new).abs()) + 2 * U) + TINY
        if m_old == -math.inf:
            alpha, dalpha = 0.0, 0.0
        else:
            alpha, dalpha = 2.0 ** (m_old - m_new), LN2 * (dm_old + dm_new + U * abs(m_old - m_new)) + 2 * U
        f, af = e[:, None] * sj, ae[:, None] * sj + U * e[:, None] * sj  # [n, nb]
        if fused:
            pi_new = f.amax(0) / 448.0
            api_new = af.amax(0) / 448.0 + U * pi_new
            y, ay = f / pi_new, af / pi_new + (f / pi_new) * (api_new / pi_new + U)
            beta = alpha * pi_old / pi_new
            dbeta = dalpha + api_old / pi_old + api_new / pi_new + 2 * U
        else:
            pi_new, api_new, y, ay = pi_old, api_old, f, af
            beta, dbeta = torch.full((nb,), alpha, dtype=torch.float64), torch.full((nb,), dalpha, dtype=torch.float64)
        if fmt is None:  # P = f in fp32: its error is f's
            p, ap = f, af
        else:
            ref_y, p = (t[:n].double() for t in ref_p[b])
            assert ((ref_y - y).abs() <= ay).all(), "the reference's P input is off the formula"
            assert ((_round_to(fmt, y - ay) <= p) & (p <= _round_to(fmt, y + ay))).all(), \
                "a P the reference used that no rounding of the formula's value gives"
            ap = torch.zeros_like(p)
        pc, pc_abs = (p[..., None] * c).sum(0), (p.abs()[..., None] * c.abs()).sum(0)  # [nb, bw]
        pc_err = (n + 1) * U * pc_abs + (ap[..., None] * c.abs()).sum(0)
        acc_err = beta[:, None] * acc_err + (dbeta[:, None] + 2 * U) * beta[:, None] * acc_abs + pc_err
        acc, acc_abs = beta[:, None] * acc + pc, beta[:, None] * acc_abs + pc_abs
        e_sum, e_err = float(e.sum()), float(ae.sum()) + n * U * float(e.sum())
        l_err = beta * l_err + (dbeta + 2 * U) * beta * l_sum + (e_err + (api_new / pi_new + 2 * U) * e_sum) / pi_new
        l_sum = beta * l_sum + e_sum / pi_new
        m_old, dm_old, pi_old, api_old = m_new, dm_new, pi_new, api_new
    if L == 0:
        return torch.zeros(c_all.shape[-1], dtype=torch.float64), -math.inf, 0.0, 0.0, torch.zeros(1)
    out = acc / l_sum[:, None]
    out_err = acc_err / l_sum[:, None] + out.abs() * (l_err / l_sum + U)[:, None]
    log2_lpi = math.log2(float(l_sum[0] * pi_old[0]))
    lse = (m_old + log2_lpi) * LN2
    lse_err = (LN2 * dm_old + float(l_err[0] / l_sum[0] + api_old[0] / pi_old[0]) + U + 2 * U * LN2 * abs(log2_lpi)
               + U * LN2 * abs(m_old + log2_lpi) + U * abs(lse))
    slack = 1.01  # the second-order terms: products of two relative errors, each < 1e-2 (checked by callers)
    return out.flatten(), lse, slack * out_err.flatten(), slack * lse_err, (acc_abs / l_sum[:, None]).flatten()


class _Recorder:
    """Stands in for a rounding inside mla_decode_reference and keeps (input, output) of each call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, x):
        out = self.fn(x)
        self.calls.append((x.clone(), out.clone()))
        return out


def _decode_checked_against_formula(monkeypatch, q, kv, lengths=None, softmax_scale=None, config=None, *,
                                    causal=True, round_16bit=True, max_rel_bound=5e-3):
    """mla_decode_reference(...), checked row by row against _formula_decode with its bounds; returns it.
    `max_rel_bound` keeps the check sharp: no bound may exceed that fraction of its row's magnitude scale."""
    cfg = config or kv.config
    pv = cfg.pv if (round_16bit or cfg.pv != "bf16") else "unrounded"
    e4m3 = decode_module.get_element_format("fp8_e4m3")
    rec = _Recorder(e4m3.round_trip if pv == "fp8_scale_fused" else decode_module.round_bf16)
    with monkeypatch.context() as mp:
        if pv == "fp8_scale_fused":
            fmt = type("RecordingE4M3", (), {"qmax": e4m3.qmax, "round_trip": staticmethod(rec)})()
            real = decode_module.get_element_format
            mp.setattr(decode_module, "get_element_format", lambda name, *a: fmt if name == "fp8_e4m3" else real(name, *a))
        elif pv == "bf16":
            mp.setattr(decode_module, "round_bf16", rec)
        out, lse = sq.mla_decode_reference(q, kv, lengths, softmax_scale, config, causal=causal, round_16bit=round_16bit)
    single = q.dim() == 3
    q4, out4, lse4 = (q[:, None], out[:, None], lse[:, None]) if single else (q, out, lse)
    B, S, H, D = q4.shape
    r = kv.latent.width
    tau = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    q_nope, q_rope, sigma = sq.quantize_query(q4, cfg, r, round_16bit)
    codes, scales = kv.latent.codes_f32(), kv.latent.token_scales()
    rope = kv.rope.codes_f32() if kv.rope_prescaled else kv.rope.dequantize(torch.float32)
    T = codes.shape[1]
    lengths = torch.full((B,), T) if lengths is None else lengths
    for b in range(B):
        for s in range(S):
            L = int(lengths[b]) - ((S - 1 - s) if causal else 0)
            L = max(L, 0)
            for h in range(H):
                ref_p = [(x[b, s, h], p[b, s, h]) for x, p in rec.calls] if pv != "unrounded" else None
                o, lse_f, o_err, lse_err, scale = _formula_decode(
                    q_nope[b, s, h], q_rope[b, s, h], float(sigma[b, s, h]), codes[b], scales[b], rope[b], tau, L,
                    pv=pv, prescaled=kv.rope_prescaled, ref_p=ref_p)
                if L == 0:
                    assert (out4[b, s, h] == 0).all() and lse4[b, s, h] == -math.inf
                    continue
                assert (o_err <= max_rel_bound * scale).all() and lse_err <= max_rel_bound, (b, s, h)
                diff = (out4[b, s, h].double() - o).abs()
                assert (diff <= o_err).all(), (b, s, h, float((diff / o_err).max()))
                assert abs(float(lse4[b, s, h]) - lse_f) <= lse_err, (b, s, h)
    return out, lse


@pytest.mark.parametrize("L", [1, 64, 100, 200])
def test_scale_fused_pv_matches_the_formula_step_by_step(L, monkeypatch):
    latent, rope = synthetic_latent_rope(200, 64, 16, seed=L)
    q = synthetic_queries(latent, rope, 4, seed=L + 1)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    _decode_checked_against_formula(monkeypatch, q, kv, torch.tensor([L]))


def test_formula_check_catches_a_slightly_wrong_reference(monkeypatch):
    """The bounds are the fp32 arithmetic's, far tighter than any formula error: a reference whose
    log2(e) is 1e-4 off (every logit 1e-4 too large) fails the check."""
    latent, rope = synthetic_latent_rope(200, 64, 16, seed=100)
    q = synthetic_queries(latent, rope, 4, seed=101)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    monkeypatch.setattr(decode_module, "LOG2E", decode_module.LOG2E * (1 + 1e-4))
    with pytest.raises(AssertionError):
        _decode_checked_against_formula(monkeypatch, q, kv, torch.tensor([100]))


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


def test_quantized_prefill_equals_step_by_step_decode_for_per_token_formats(monkeypatch):
    """For per-token scales, all positions attending to the quantized cache at once (S = T, causal)
    gives what token-by-token decode over the growing cache gives: the growing cache holds the same
    codes, and every row of both runs is the formula over its visible tokens within the fp32 bounds of
    _formula_decode (the [S = 70] batch may be summed in another order than a single row)."""
    latent, rope = synthetic_latent_rope(70, 64, 16, batch=1, seed=11)
    q = torch.randn(1, 70, 4, 80) * 0.3
    cfg = sq.PRESETS["snapmla"]
    kv = sq.quantize_kv(latent, rope, cfg)
    _decode_checked_against_formula(monkeypatch, q, kv, torch.tensor([70]))
    for t in (0, 1, 63, 64, 69):
        step = sq.quantize_kv(latent[:, : t + 1], rope[:, : t + 1], cfg)
        assert torch.equal(step.latent.codes_f32(), kv.latent.codes_f32()[:, : t + 1])
        assert torch.equal(step.latent.token_scales(), kv.latent.token_scales()[:, : t + 1])
        assert torch.equal(step.rope.codes_f32(), kv.rope.codes_f32()[:, : t + 1])
        _decode_checked_against_formula(monkeypatch, q[:, t], step)


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
