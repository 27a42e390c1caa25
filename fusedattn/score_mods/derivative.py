"""Whether a cuDNN-native score_mod without a bprop really has derivative 1 in the score.

cuDNN's backward multiplies dLoss/d(output of score_mod) by the bprop callback's result, or by 1
when there is none. That is right for added terms (score + bias, score - slope * distance) and
for masks (entries replaced by MASKED get no probability, so their derivative does not matter),
and silently wrong for anything else (score * 0.5, tanh(score), ...). This module reads the
recorded structure of a callback (`key.structural_key`) and names the first op that breaks the
rule, so the cudnn backend can refuse such a call instead of returning wrong gradients.
"""

from __future__ import annotations

from fusedattn.score_mods.core import MASKED_BELOW, RuntimeScalar

__all__ = ["score_derivative_issue"]

SCORE = ("score",)
# Ops whose output is (score + something free of the score) when exactly one operand is such a
# shifted score and the other is free of it; for "sub" the score must be the left operand.
_SHIFTING = {"add": ("a", "b"), "sub": ("a",)}
_OPERANDS = ("a", "b")
_TENSOR_KINDS = ("op", "aux", "score")
_SHAPE_ONLY = frozenset({"gen_index"})  # reads the score's shape, not its values


def _is_masking_value(token, values: dict) -> bool:
    """A tensor that holds a masked score (<= MASKED_BELOW): a runtime scalar we can read."""
    if token[0] == "const":
        return float(token[2]) <= MASKED_BELOW
    if token[0] != "aux":
        return False
    value = values.get(token[1])
    return isinstance(value, RuntimeScalar) and float(value.value) <= MASKED_BELOW


def score_derivative_issue(key: tuple, values: dict) -> str | None:
    """None when the forward callback recorded in `key` is the score plus score-free terms, with
    masked entries only; else why its derivative is not 1 (naming the op). values: the bound aux."""
    _, (_, result), _, calls = key
    shifted = {SCORE}  # tokens equal to score + (terms free of the score)
    dependent = {SCORE}  # tokens that depend on the score at all
    for head, args, named in calls:
        if head[0] != "op":
            continue  # tensor methods (set_data_type, ...) return the same tensor
        name, token = head[1], ("op", head[2])
        if name in _SHAPE_ONLY:
            continue
        inputs = dict(named)
        operands = [v for v in (*args, *inputs.values()) if isinstance(v, tuple) and v and v[0] in _TENSOR_KINDS]
        if not any(v in dependent for v in operands):
            continue  # free of the score
        dependent.add(token)
        if name.startswith(("cmp_", "logical_")):
            continue  # a condition on the score: wrong only where it is used (see binary_select)
        if name in _SHIFTING:
            score_side = [side for side in _OPERANDS if inputs.get(side) in dependent]
            if (len(score_side) == 1 and score_side[0] in _SHIFTING[name] and inputs[score_side[0]] in shifted
                    and len(operands) == 2):
                shifted.add(token)
                continue
            if name == "sub" and score_side == ["b"]:
                return "op 'sub' subtracts the score (derivative -1)"
        if name == "binary_select":
            chosen, other, condition = inputs.get("input0"), inputs.get("input1"), inputs.get("mask")
            if condition in dependent:
                return "op 'binary_select' picks by a condition on the score (derivative 0 where it switches)"
            pair = [(chosen, other), (other, chosen)]
            if any(a in shifted and b is not None and b not in dependent and _is_masking_value(b, values)
                   for a, b in pair):
                shifted.add(token)
                continue
            return ("op 'binary_select' replaces scores by a value that is not a mask (a runtime scalar "
                    f"<= {MASKED_BELOW:g}): its derivative is 0 there, not 1")
        return f"op '{name}' of the score (its derivative is not 1)"
    if result not in dependent:
        return "the result does not depend on the score (derivative 0)"
    if result not in shifted:
        return "the result is not the score plus terms free of it"
    return None
