"""`longattn.numerics` is the only home of the numerical rules, and each rule does what its docstring says.

Shape legend: b batch, h heads, n queries, m keys, d head dim.
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_checks import DOUBLE

import longattn
from longattn.numerics import (
    EXACTLY_HIDDEN,
    HALF_HIDDEN_PENALTY,
    HIDDEN_LOGIT,
    LOG_SPACE_HIDDEN,
    NO_KEY_LSE,
    SAFE_LOGIT_BOUND,
    apply_rotary,
    compute_dtype,
    default_scale,
    head_groups,
    hidden_logit,
    hide_exactly,
    hide_logits,
    logit_bound,
    merge_attention,
    rotary_inverse_frequencies,
    rotate,
    rotate_half,
    sees_a_key,
    zero_empty_shift,
)

PACKAGE = Path(longattn.__file__).parent

# ---------------------------------------------------------------------------------------------- no copies outside

RULES = {
    "a softmax-scale formula (use numerics.default_scale)": re.compile(
        r"\*\*\s*\(?\s*-?\s*0?\.5(?!\d)|\b(?:r?sqrt)\s*\("
    ),
    "a compute-dtype promotion rule (use numerics.compute_dtype)": re.compile(
        r"torch\.(?:float16|bfloat16|half)\s*,\s*torch\.(?:float16|bfloat16|half)"
        r"|torch\.float64\s+if\b.*\belse\s+torch\.float32|torch\.float32\s+if\b.*\belse\b"
    ),
    "a masked-logit constant (use the numerics constants or hide_logits)": re.compile(
        r"(?<![\w.])\d+(?:\.\d*)?[eE]\+?(?:[4-9]|\d{2,})\b|(?<![\w.])\d{5,}(?:\.\d*)?\b|\bfinfo\s*\("
    ),
}

# Code outside numerics.py that matches a rule for another reason: (file, code snippet on the line) -> why.
ALLOWED = {
    (
        "attention_linformer.py",
        "math.sqrt(self.max_len + self.proj_len)",
    ): "the init std of E and F (1/sqrt(fan)), not a softmax scale",
    ("ops_routing.py", "math.sqrt(n / size)"): "the group size that minimises G + size·g, not a softmax scale",
    ("ops_lsh_hashing.py", "math.sqrt(length // bucket_size)"): "the bound on the number of hash buckets",
    (
        "ops_lsh_hashing.py",
        "torch.rsqrt(mean_square) / math.sqrt(x.shape[-1])",
    ): "unit-length shared-QK keys x / sqrt(|x|² + d·eps); LSH scores are not scaled",
    (
        "ops_lsh_chunks.py",
        "SELF_SCORE = -1e5",
    ): "Reformer's score of a query's own key (transformers' value): a real score, not a hidden logit",
    (
        "executor_xformers.py",
        "math.sqrt(HIDDEN_PENALTY / scale)",
    ): "the bias columns' magnitude a with a²·scale = the penalty, not a softmax scale",
    (
        "executor_xformers.py",
        "(torch.float16, torch.bfloat16, torch.float32)",
    ): "the dtypes xformers' kernels accept, not a promotion rule",
    (
        "backends.py",
        "(torch.float16, torch.bfloat16, torch.float32)",
    ): "the dtypes FlexAttention's CUDA kernels accept, not a promotion rule",
    ("configuration_longattn.py", "rope_theta: float = 10000.0"): "RoFormer's rotary base, not a logit",
}


def _code_lines(source: str) -> list[str]:
    """`source`'s lines with strings and comments blanked: docstrings and messages may name the formulas."""
    lines = source.splitlines()
    chars = [list(line) for line in lines]
    text_tokens = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in text_tokens:
            continue
        (first, start), (last, stop) = token.start, token.end
        for row in range(first, last + 1):
            begin = start if row == first else 0
            end = stop if row == last else len(chars[row - 1])
            chars[row - 1][begin:end] = " " * (end - begin)
    return ["".join(line) for line in chars]


def _violations(files: dict[str, str]) -> tuple[list[str], set[tuple[str, str]]]:
    """The rule matches in `files` (name -> source) that no ALLOWED entry covers, and the entries that were used."""
    found, used = [], set()
    for name, source in sorted(files.items()):
        for number, line in enumerate(_code_lines(source), start=1):
            for rule, pattern in RULES.items():
                if not pattern.search(line):
                    continue
                covered = [key for key in ALLOWED if key[0] == name and key[1] in line]
                used.update(covered)
                if not covered:
                    found.append(f"{name}:{number}: {rule}: {line.strip()}")
    return found, used


def _package_sources() -> dict[str, str]:
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8")
        for path in PACKAGE.rglob("*.py")
        if path.name != "numerics.py"
    }


def test_numerical_rules_live_only_in_numerics():
    found, used = _violations(_package_sources())
    assert not found, "numerical rules written outside longattn/numerics.py:\n" + "\n".join(found)
    stale = set(ALLOWED) - used
    assert not stale, f"allow-list entries that no longer match any line (remove them): {sorted(stale)}"


@pytest.mark.parametrize(
    "line",
    [
        "    scale = 1.0 / math.sqrt(d) if scale is None else scale",
        "    scale = q.shape[-1] ** -0.5",
        "    scale = q.shape[-1]**-0.5",
        "    scores = scores / head_dim ** 0.5",
        "    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype",
        "    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32",
        "    scores = scores.masked_fill(~mask, -1e30)",
        "    bias = bias.masked_fill(~mask, -1e9)",
        "    bias = bias.masked_fill(~mask, -1E4)",
        "    bias = bias.masked_fill(~mask, -10000.0)",
        "    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)",
        # An allowed snippet in another file is still a violation.
        "    group = int(math.sqrt(n / size))",
    ],
)
def test_rule_scan_catches_a_new_copy(line):
    found, _ = _violations(
        {"attention_new.py": f"import math\n\n\ndef f(q, k, d, n, size, mask, scores, bias):\n{line}\n"}
    )
    assert len(found) == 1, found


def test_rule_scan_ignores_docstrings_comments_and_messages():
    source = (
        "def f(d):\n"
        '    """softmax(Q Kᵀ / sqrt(d)), hidden keys at -1e30, (torch.float16, torch.bfloat16) -> float32."""\n'
        "    x = 1  # 1/sqrt(d), d ** -0.5, finfo(dtype).min\n"
        '    raise ValueError(f"scale must be finite (or None for 1/sqrt({d})), 1e4")\n'
    )
    assert _violations({"attention_new.py": source})[0] == []


# ---------------------------------------------------------------------------------------------- -inf only by name

# -inf written out in the package outside numerics.py, allowed by (file, enclosing function) -> why. Everything else
# goes through numerics' names (EXACTLY_HIDDEN / hide_exactly, zero_empty_shift, NO_KEY_LSE), whose docstrings say
# why -inf is safe there.
RAW_NEG_INF_ALLOWED = {
    # Triton kernels (@_jit, i.e. triton.jit): compiled from their own source, where a Python float global such as
    # NO_KEY_LSE is not a constant the compiler folds; the running softmax there keeps its own -inf guards.
    ("executor_triton.py", "_query_rows"): "Triton kernel: lse -inf -> 0 before the base-2 conversion",
    ("executor_triton.py", "_band_forward_kernel"): "Triton kernel: the lse of a row without a visible key",
    ("executor_triton.py", "_softmax_start"): "Triton kernel: the running maximum before any key",
    ("executor_triton.py", "_softmax_step"): "Triton kernel: hidden scores and the zero shift of empty rows",
}

_INF_NAMES = {"inf", "infinity"}


def _is_inf(node: ast.AST) -> bool:
    """`node` spells +inf: math.inf / torch.inf / np.inf, a bare `inf`, float("inf"), or a float literal that is."""
    if isinstance(node, ast.Attribute):
        return node.attr.lower() in _INF_NAMES
    if isinstance(node, ast.Name):
        return node.id.lower() in _INF_NAMES
    if isinstance(node, ast.Constant):
        return isinstance(node.value, float) and node.value == math.inf
    return _float_of(node) in ("inf", "+inf", "infinity", "+infinity")


def _float_of(node: ast.AST) -> str | None:
    """The lower-cased string argument of a `float("...")` call, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "float"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value.strip().lower()
    return None


def _is_neg_inf(node: ast.AST) -> bool:
    """`node` spells -inf: -<inf> (see `_is_inf`), float("-inf"), or math / numpy's NINF."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_inf(node.operand)
    if isinstance(node, ast.Attribute) and node.attr == "NINF":
        return True
    return _float_of(node) in ("-inf", "-infinity")


def _raw_neg_inf(files: dict[str, str]) -> tuple[list[str], set[tuple[str, str]]]:
    """The -inf spelled out in `files` (name -> source) that RAW_NEG_INF_ALLOWED does not cover, and the entries
    that were used. Strings, comments and docstrings are not code, so they may name -inf freely."""
    found, used = [], set()
    for name, source in sorted(files.items()):
        tree = ast.parse(source, filename=name)
        scopes = {}  # node -> name of its innermost enclosing function
        for outer in ast.walk(tree):
            if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(outer):
                    if inner is not outer:
                        scopes[inner] = outer.name  # inner functions are walked later and overwrite
        for node in ast.walk(tree):
            if not _is_neg_inf(node):
                continue
            key = (name, scopes.get(node, "<module>"))
            if key in RAW_NEG_INF_ALLOWED:
                used.add(key)
            else:
                found.append(f"{name}:{node.lineno}: {key[1]}: {ast.get_source_segment(source, node)}")
    return found, used


def test_neg_inf_is_written_only_in_numerics():
    found, used = _raw_neg_inf(_package_sources())
    assert not found, (
        "-inf written outside longattn/numerics.py (use EXACTLY_HIDDEN / hide_exactly, zero_empty_shift or "
        "NO_KEY_LSE, or hide_logits where the softmax is not guarded):\n" + "\n".join(found)
    )
    stale = set(RAW_NEG_INF_ALLOWED) - used
    assert not stale, f"allow-list entries that no longer match any -inf (remove them): {sorted(stale)}"


@pytest.mark.parametrize(
    "line",
    [
        "scores = scores.masked_fill(~mask, -math.inf)",
        "scores.masked_fill_(~mask, float('-inf'))",
        'scores.masked_fill_(~mask, float("-Infinity"))',
        "neg_inf = float('-inf')",
        "lse = torch.full((3,), -torch.inf)",
        "lse = torch.where(seen, lse, -float('inf'))",
        "lse = torch.where(seen, lse, -np.inf)",
        "shift = shift.masked_fill(shift == -inf, 0.0)",
        "shift = shift.masked_fill(shift == -1e999, 0.0)",
        "bias = np.NINF",
    ],
)
def test_neg_inf_scan_catches_a_new_site(line):
    source = f"def f(scores, mask, seen, lse, shift):\n    {line}\n"
    assert len(_raw_neg_inf({"ops_new.py": source})[0]) == 1
    # The allow-list names a file and a function: the same line elsewhere is still caught.
    assert len(_raw_neg_inf({"executor_triton.py": source})[0]) == 1
    assert _raw_neg_inf({"executor_triton.py": source.replace("def f(", "def _softmax_step(")})[0] == []


def test_neg_inf_scan_ignores_text_and_positive_inf():
    source = (
        "def f(lse):\n"
        '    """Rows without a key have lse = -inf (masked_fill(~mask, -math.inf) is not used)."""\n'
        "    lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # +inf: exp(s - inf) = 0, never -inf\n"
        '    raise ValueError(f"lse must not be {float(\'-inf\')!r}"[:0] + "-inf")\n'
    )
    found, _ = _raw_neg_inf({"ops_new.py": source})
    assert len(found) == 1 and "float('-inf')" in found[0]  # an f-string's expression is code
    assert _raw_neg_inf({"ops_new.py": source.replace("{float('-inf')!r}", "x")})[0] == []


def test_exact_hiding_helpers():
    # hide_exactly: -inf where hidden, a copy unless in place; the guarded softmax leaves hidden keys at exactly 0
    # and a row with every key hidden at zeros, never NaN.
    scores = torch.tensor([[3.0, 1e30, -2.0], [5.0, 6.0, 7.0]])
    hidden = torch.tensor([[False, True, False], [True, True, True]])
    hid = hide_exactly(scores, hidden)
    assert hid.tolist() == [[3.0, -math.inf, -2.0], [-math.inf] * 3] and scores[0, 1] == 1e30
    assert EXACTLY_HIDDEN == NO_KEY_LSE == -math.inf
    shift = hid.amax(dim=-1, keepdim=True)
    assert shift[1].item() == NO_KEY_LSE and torch.isnan((hid - shift).exp()[1]).all()  # the unguarded shift
    safe = zero_empty_shift(shift)
    assert safe.tolist() == [[3.0], [0.0]] and shift[1].item() == NO_KEY_LSE  # a copy unless in place
    weights = (hid - safe).exp()
    assert weights[0, 1] == 0 and (weights[1] == 0).all() and torch.isfinite(weights).all()
    # In place: the same tensor back, written into.
    assert hide_exactly(scores, hidden, inplace=True) is scores and torch.equal(scores, hid)
    assert zero_empty_shift(shift, inplace=True) is shift and torch.equal(shift, safe)


# ---------------------------------------------------------------------------------------------- scale and dtypes


@pytest.mark.parametrize("d", [8, 32, 64, 96])
def test_default_scale_is_sdpas_default(d):
    assert default_scale(d) == 1.0 / math.sqrt(d)
    q, k, v = torch.randn(3, 1, 2, 5, d, **DOUBLE)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, scale=default_scale(d)), F.scaled_dot_product_attention(q, k, v)
    )


def test_compute_dtype_promotes_halves_only():
    table = {
        torch.float16: torch.float32,
        torch.bfloat16: torch.float32,
        torch.float32: torch.float32,
        torch.float64: torch.float64,
    }
    assert {dtype: compute_dtype(dtype) for dtype in table} == table


@pytest.mark.parametrize("bound", [None, 1.0], ids=["unknown bound", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_hide_logits_follows_the_rule(dtype, bound):
    assert hidden_logit(dtype) == torch.finfo(dtype).min
    # A hidden key weighs exactly 0, an all-hidden row stays finite (-inf alone gives NaN) and is told by its mask.
    scores = torch.tensor([[3.0, -2.0, 5.0], [0.0, 0.0, 0.0]], dtype=dtype)
    hidden = torch.tensor([[False, True, True], [True, True, True]])
    probs = torch.softmax(hide_logits(scores, hidden, bound=bound), dim=-1)
    assert probs[0].tolist() == [1.0, 0.0, 0.0]
    assert torch.isfinite(probs).all()
    assert sees_a_key(hidden).view(-1).tolist() == [True, False]
    assert scores[0].tolist() == [3.0, -2.0, 5.0]  # not in place unless asked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_hide_logits_is_exact_for_logits_beyond_the_hidden_constant(dtype):
    # Real logits far below HIDDEN_LOGIT (and hidden ones far above the visible): the mask decides, not the values.
    big = 3e32 if dtype != torch.float64 else 1e300
    scores = torch.tensor([[-big, big, -2 * big], [big, -big, 0.0]], dtype=dtype)
    hidden = torch.tensor([[False, True, False], [True, True, True]])
    probs = torch.softmax(hide_logits(scores, hidden), dim=-1)
    assert probs[0].tolist() == [1.0, 0.0, 0.0]
    assert torch.isfinite(probs).all()
    # Beyond the safe bound the fast additive path is not taken, whatever bound is passed in.
    assert hide_logits(scores, hidden, bound=big)[0, 1] == -math.inf


def test_logit_bound_bounds_every_logit():
    q, k = torch.randn(2, 3, 5, 4, **DOUBLE), torch.randn(2, 3, 7, 4, **DOUBLE)
    bias = torch.randn(2, 3, 5, 7, **DOUBLE)
    bound = logit_bound(q, k, 0.5, bias)
    assert (0.5 * q @ k.transpose(-1, -2) + bias).abs().max() <= bound
    assert logit_bound(q * 1e20, k * 1e20, 1.0) > SAFE_LOGIT_BOUND
    assert not logit_bound(q.masked_fill(q > 0, math.nan), k, 1.0) <= SAFE_LOGIT_BOUND  # NaN: never "safe"


def test_logit_bound_of_float32_inputs_is_never_below_the_exact_one():
    """float32 q and k are reduced in float32 (no float64 copy), widened by a margin: never below the bound of their
    exact (float64) row norms, for long rows and for values whose float32 squares overflow or underflow."""
    for seed in range(8):
        generator = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 2, 64, 1024, generator=generator)
        k = torch.randn(1, 2, 80, 1024, generator=generator)
        for factor in (1.0, 1e25, 1e-25):  # in range; squares past float32's range; squares below its normal range
            qs, ks = q * factor, k * factor
            exact = [float(torch.linalg.vector_norm(t.double(), dim=-1).amax()) for t in (qs, ks)]
            bound = logit_bound(qs, ks, 0.125)
            assert math.isfinite(bound)
            assert bound >= 0.125 * exact[0] * exact[1]
            assert bound <= 0.125 * exact[0] * exact[1] * 1.01


def test_masked_logit_constants_hold_their_stated_properties():
    f32 = dict(dtype=torch.float32)
    # HIDDEN_LOGIT: finite in float32, s + HIDDEN_LOGIT neither overflows nor leaves any weight.
    added = torch.tensor([1e4, -1e4], **f32) + HIDDEN_LOGIT
    assert torch.isfinite(added).all() and (torch.exp(added - 1e4) == 0).all()
    # HALF_HIDDEN_PENALTY: representable in float16, exp(-penalty) is 0 in float32.
    assert torch.tensor(HALF_HIDDEN_PENALTY, dtype=torch.float16).item() == HALF_HIDDEN_PENALTY
    assert torch.exp(torch.tensor(-HALF_HIDDEN_PENALTY, **f32)) == 0
    # LOG_SPACE_HIDDEN: vanishes after exp(), and Sinkhorn's alternating normalisations of a matrix with an
    # all-hidden row stay finite (with -inf that row's log_softmax is NaN).
    blocked = torch.zeros(4, 4, dtype=torch.bool)
    blocked[0] = True
    x = torch.randn(4, 4, **f32).masked_fill(blocked, LOG_SPACE_HIDDEN)
    for _ in range(20):
        x = torch.log_softmax(x, dim=-2).masked_fill(blocked, LOG_SPACE_HIDDEN)
        x = torch.log_softmax(x, dim=-1).masked_fill(blocked, LOG_SPACE_HIDDEN)
    assert torch.isfinite(x).all() and (x.exp()[blocked] == 0).all()


# ---------------------------------------------------------------------------------------------- merge_attention


def _attention_over(q, k, v, visible):
    """Softmax attention of q `[b, h, n, d]` over the visible keys (bool `[n, m]`): (out, lse), zero / -inf rows."""
    scores = (q @ k.transpose(-1, -2) * default_scale(q.shape[-1])).masked_fill(~visible, -math.inf)
    lse = scores.logsumexp(dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe.unsqueeze(-1)) @ v, lse


def test_merge_attention_equals_one_softmax_over_the_union():
    torch.manual_seed(0)
    b, h, n, m, d = 2, 3, 6, 10, 8
    q, k, v = (torch.randn(b, h, size, d, **DOUBLE, requires_grad=True) for size in (n, m, m))
    part = torch.randint(0, 3, (n, m))  # each key of each query row goes to one of three disjoint parts
    union = torch.ones(n, m, dtype=torch.bool)
    union[0] = False  # a row that sees no key at all
    part[1] = 2  # a row whose keys are all in the last part: the others are empty for it
    partials = [_attention_over(q, k, v, (part == index) & union) for index in range(3)]
    out, lse = merge_attention(partials)
    expected_out, expected_lse = _attention_over(q, k, v, union)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    assert (out[:, :, 0] == 0).all() and torch.isneginf(lse[:, :, 0]).all()

    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0.0)
    grads = torch.autograd.grad(
        (out * grad_out).sum() + (lse.masked_fill(torch.isneginf(lse), 0) * grad_lse).sum(), (q, k, v)
    )
    expected_lse = expected_lse.masked_fill(torch.isneginf(expected_lse), 0)
    expected = torch.autograd.grad((expected_out * grad_out).sum() + (expected_lse * grad_lse).sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_merge_attention_of_one_part_and_half_outputs():
    out, lse = torch.randn(2, 4, 3), torch.randn(2, 4)
    assert merge_attention([(out, lse)])[0] is out
    # Half outputs with float32 lse (as executors return them): merged in float32, returned in the output dtype.
    half = [(out.to(torch.bfloat16), lse), (torch.randn(2, 4, 3).to(torch.bfloat16), torch.full((2, 4), -math.inf))]
    merged, merged_lse = merge_attention(half)
    assert merged.dtype == torch.bfloat16 and merged_lse.dtype == torch.float32
    torch.testing.assert_close(merged, half[0][0])
    torch.testing.assert_close(merged_lse, lse)


# ---------------------------------------------------------------------------------------------- head_groups


def test_head_groups():
    assert head_groups(2, 3) == [(2, [0, 1, 2])]
    assert head_groups([1, 2, 1, 4, 2], 5) == [(1, [0, 2]), (2, [1, 4]), (4, [3])]


# ---------------------------------------------------------------------------------------------- rotary


def _omega(head_dim, theta=10000.0):
    """The d/2 rotary frequencies theta^(-2i/d) in float64."""
    return theta ** (-torch.arange(0, head_dim, 2, **DOUBLE) / head_dim)


def _cos_sin(positions, head_dim):
    """cos, sin `[b, n, d]` as the model builds them: the angles of the d/2 frequencies, repeated for both halves."""
    angles = positions[..., None].to(torch.float64) * _omega(head_dim)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _complex_rotation(x, positions):
    """Su et al.'s rotation as complex multiplication: pair (x_i, x_{i+d/2}) is z_i, turned by e^{i·pos·ω_i}."""
    d = x.shape[-1]
    omega = _omega(d)  # [d/2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    turned = z * torch.polar(torch.ones_like(omega), positions[..., None].to(torch.float64) * omega)
    return torch.cat((turned.real, turned.imag), dim=-1)


def test_rotary_inverse_frequencies():
    torch.testing.assert_close(rotary_inverse_frequencies(8, 500.0), _omega(8, 500.0).float())


def test_rotary_equals_complex_rotation():
    torch.manual_seed(0)
    b, h, n, d = 2, 3, 7, 8
    q, k = torch.randn(2, b, h, n, d, **DOUBLE)
    positions = torch.stack([torch.arange(n), torch.arange(n) + 5])  # [b, n]
    cos, sin = _cos_sin(positions, d)  # [b, n, d]
    rotated_q, rotated_k = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(rotated_q, _complex_rotation(q, positions[:, None]))
    torch.testing.assert_close(rotated_k, _complex_rotation(k, positions[:, None]))
    # One tensor in the token layout [b, n, h, d] (Linformer's): cos, sin broadcast over the heads.
    tokens = q.transpose(1, 2)
    torch.testing.assert_close(rotate(tokens, cos[:, :, None], sin[:, :, None]), rotated_q.transpose(1, 2))
    assert torch.equal(rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
