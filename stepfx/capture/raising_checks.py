"""Checks that read a tensor and only raise become run-time assertions.

Libraries validate batches with Python on tensor values::

    if labels.max() >= self.config.vocab_size:
        raise ValueError(f"Label values must be <= vocab_size: {self.config.vocab_size}")

Tracing cannot take that branch on a fake tensor (its value is unknown).
When one side of the branch does nothing but raise, capture takes the
other side (the batch is good) and records the check in the graph as
``aten._assert_async.msg(<the condition is good>, <the raised message>)``,
so a bad batch still raises when the step runs (on CPU at once; on CUDA the
assertion is asynchronous, like any device-side assert).

How the branch is recognised, from the frame that converts the tensor to a
bool (the innermost user frame when ``aten._local_scalar_dense`` is
dispatched):

- its current instruction is the conditional jump (``POP_JUMP_*_IF_*``;
  ``TO_BOOL`` before one on Python 3.13) that consumes the truth value;
- from one of the jump's two successors, straight-line code (following
  unconditional jumps only) reaches ``RAISE_VARARGS``, and every instruction
  on that path lies inside one ``raise`` or ``assert`` statement of the
  source (``ast``): that truth value raises, whatever else holds, and
  nothing else happens on the way. The other value is traced as usual.

A ``try``/``except`` around the check that catches the exception is not
seen: the assertion fails the step where eager code would have caught it.

Also here: an ``if`` whose body only clamps a tensor into the same name
(transformers' fp16 overflow guard) is entered while tracing and each clamp
selected by the traced condition (``clamping_branch``, below).
"""
from __future__ import annotations

import ast
import dis
import functools
import linecache
import sys
import types
from dataclasses import dataclass

import torch

from .source import format_frame, is_user_file

__all__ = ["ClampingBranch", "RaisingCheck", "clamping_branch", "in_clamping_body", "raising_check"]

_COND_JUMPS = {
    "POP_JUMP_IF_FALSE": False, "POP_JUMP_IF_TRUE": True,
    "POP_JUMP_FORWARD_IF_FALSE": False, "POP_JUMP_FORWARD_IF_TRUE": True,
    "POP_JUMP_BACKWARD_IF_FALSE": False, "POP_JUMP_BACKWARD_IF_TRUE": True,
}  # opname -> the truth value that takes the jump
_GOTO = frozenset({"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP", "JUMP_NO_INTERRUPT"})
_STOP = frozenset({"RETURN_VALUE", "RETURN_CONST", "RERAISE", "YIELD_VALUE", "RESUME"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_MAX_PATH = 400  # instructions followed from the jump before giving up


@dataclass(frozen=True)
class RaisingCheck:
    """A truth test whose one outcome only raises."""

    passes_when: bool  # the truth value with which the code goes on
    message: str  # what the step raises at run time when the check fails
    source: str  # the user's line of the check


def _user_frame() -> types.FrameType | None:
    """The innermost frame of the user's (or a library's) code on the running stack."""
    frame = sys._getframe(2)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def raising_check() -> RaisingCheck | None:
    """The check the innermost user frame is evaluating, if the tensor being
    converted to a bool decides a branch whose one side only raises."""
    frame = _user_frame()
    if frame is None:
        return None
    found = _raising_side(frame.f_code, frame.f_lasti)
    if found is None:
        return None
    bad_value, raise_offset = found
    node = _statement_at(frame.f_code, raise_offset)
    if node is None:
        return None
    filename = frame.f_code.co_filename
    line = linecache.getline(filename, frame.f_lineno)
    where = format_frame(filename, frame.f_lineno, frame.f_code.co_name, line or None)
    return RaisingCheck(passes_when=not bad_value, message=f"{_message(node, frame)} (check at {where})", source=where)


@functools.lru_cache(maxsize=1024)
def _instructions(code: types.CodeType) -> tuple[tuple[dis.Instruction, ...], dict[int, int]]:
    instructions = tuple(dis.get_instructions(code))
    return instructions, {ins.offset: i for i, ins in enumerate(instructions)}


def _conditional_jump(code: types.CodeType, lasti: int) -> tuple[int, dis.Instruction, bool] | None:
    """(its index, the instruction, the truth value that takes it) for the conditional jump that consumes the
    truth value being computed at ``lasti`` (past a ``TO_BOOL``), with an instruction after it; else None."""
    instructions, index = _instructions(code)
    i = index.get(lasti)
    if i is None:
        return None
    if instructions[i].opname == "TO_BOOL" and i + 1 < len(instructions):
        i += 1
    jump = instructions[i]
    taken = _COND_JUMPS.get(jump.opname)
    if taken is None or i + 1 >= len(instructions):
        return None
    return i, jump, taken


@functools.lru_cache(maxsize=4096)
def _raising_side(code: types.CodeType, lasti: int) -> tuple[bool, int] | None:
    """(the truth value that leads only to a raise, offset of the raise) for
    the conditional jump at ``lasti``, or None."""
    found = _conditional_jump(code, lasti)
    if found is None:
        return None
    i, jump, taken = found
    index = _instructions(code)[1]
    on_jump = _raise_path(code, index.get(jump.argval))
    on_fall = _raise_path(code, i + 1)
    if (on_jump is None) == (on_fall is None):
        return None  # neither side raises outright (or both do)
    if on_jump is not None:
        return taken, on_jump
    return not taken, on_fall


def _raise_path(code: types.CodeType, i: int | None) -> int | None:
    """Offset of the ``RAISE_VARARGS`` that straight-line code from
    instruction ``i`` reaches, when every instruction on the way belongs
    to that raise's (or assert's) statement; else None."""
    instructions, index = _instructions(code)
    seen: list[dis.Instruction] = []
    while i is not None and i < len(instructions) and len(seen) < _MAX_PATH:
        ins = instructions[i]
        if ins.opname == "RAISE_VARARGS":
            node = _statement_at(code, ins.offset)
            if node is None or not all(_inside(node, s) for s in seen):
                return None
            return ins.offset
        if ins.opname in _GOTO:
            seen.append(ins)
            i = index.get(ins.argval)
            continue
        if ins.opname in _STOP or ins.opcode in _JUMPS:
            return None
        seen.append(ins)
        i += 1
    return None


def _inside(node: ast.stmt, ins: dis.Instruction) -> bool:
    pos = ins.positions
    if pos is None or pos.lineno is None:
        return True  # bookkeeping instructions carry no position
    start = (node.lineno, node.col_offset)
    end = (node.end_lineno, node.end_col_offset)
    return start <= (pos.lineno, pos.col_offset or 0) and (pos.end_lineno or pos.lineno, pos.end_col_offset or 0) <= end


def _statement_at(code: types.CodeType, offset: int) -> ast.Raise | ast.Assert | None:
    """The innermost ``raise``/``assert`` statement of the source holding
    the instruction at ``offset``."""
    instructions, index = _instructions(code)
    ins = instructions[index[offset]]
    pos = ins.positions
    if pos is None or pos.lineno is None:
        return None
    best = None
    for node in _raise_statements(code.co_filename):
        if node.lineno <= pos.lineno <= node.end_lineno and _inside(node, ins):
            if best is None or (node.lineno, node.col_offset) >= (best.lineno, best.col_offset):
                best = node
    return best


def _raise_statements(filename: str) -> list[ast.stmt]:
    text = "".join(linecache.getlines(filename))
    return _parsed(filename, text)


@functools.lru_cache(maxsize=64)
def _parsed(filename: str, text: str) -> list[ast.stmt]:
    try:
        tree = ast.parse(text, filename)
    except (SyntaxError, ValueError):
        return []
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Raise, ast.Assert))]


# Expressions a message may be built from without running user code on
# tensors: constants, names and attributes, f-strings and + / % of those.
_STATIC = (ast.Constant, ast.JoinedStr, ast.FormattedValue, ast.Name, ast.Attribute, ast.BinOp, ast.Add, ast.Mod,
           ast.Load, ast.Tuple)


def _message(node: ast.Raise | ast.Assert, frame: types.FrameType) -> str:
    """``ExcType: text`` as the statement would raise it when its text is
    built from plain values; else the statement's source."""
    if isinstance(node, ast.Assert):
        cls_expr, args = None, [node.msg] if node.msg is not None else []
    elif node.exc is not None:
        exc = node.exc
        cls_expr, args = (exc.func, exc.args) if isinstance(exc, ast.Call) and not exc.keywords else (exc, [])
    else:
        cls_expr, args = ast.Constant(None), []  # a bare re-raise: not a plain exception type
    try:
        cls = AssertionError if cls_expr is None else _evaluate(cls_expr, frame) if _is_dotted(cls_expr) else None
        if isinstance(cls, type) and issubclass(cls, BaseException) and all(_static(a, frame) for a in args):
            return f"{cls.__name__}: {cls(*[_evaluate(a, frame) for a in args])}"
    except Exception:  # noqa: BLE001 - fall back to the source text
        pass
    text = ast.get_source_segment("".join(linecache.getlines(frame.f_code.co_filename)), node)
    return text or "a check failed"


def _is_dotted(expr: ast.expr) -> bool:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, ast.Name)


def _static(expr: ast.expr, frame) -> bool:
    for sub in ast.walk(expr):
        if not isinstance(sub, _STATIC + (ast.operator, ast.expr_context)):
            return False
        if isinstance(sub, (ast.Name, ast.Attribute)):
            value = _evaluate(sub, frame)
            if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
                return False
    return True


def _evaluate(expr: ast.expr, frame):
    code = compile(ast.Expression(body=expr), "<stepfx check message>", "eval")
    return eval(code, frame.f_globals, dict(frame.f_locals))  # noqa: S307 - names and attributes only (_STATIC)


# -- branches that only clamp ----------------------------------------------------
#
# Libraries guard 16-bit overflow on the values (transformers' BART-family encoder layers)::
#
#     if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
#         clamp_value = torch.finfo(hidden_states.dtype).max - 1000
#         hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
#
# An ``if`` without ``else`` whose body only computes constants (``torch.finfo``, arithmetic) and clamps
# tensors is entered while tracing, and each clamp in it becomes ``where(the body runs, clamp(x), x)``:
# the device decides, and the result is eager's on either side.

_CLAMPS = frozenset({"clamp", "clip"})


@dataclass(frozen=True)
class ClampingBranch:
    """A truth test that decides an ``if`` whose body only clamps tensors."""

    body_when: bool  # the truth value that runs the body
    code: types.CodeType  # the frame holding the ``if``
    lines: tuple[int, int]  # the body's first and last line
    source: str  # the user's line of the test


def clamping_branch() -> ClampingBranch | None:
    """The branch the innermost user frame is deciding, if its body only clamps (see above)."""
    frame = _user_frame()
    if frame is None:
        return None
    found = _clamping_body(frame.f_code, frame.f_lasti)
    if found is None:
        return None
    body_when, lines, node = found
    if not _only_clamps(node.body, frame):
        return None
    filename = frame.f_code.co_filename
    line = linecache.getline(filename, frame.f_lineno)
    return ClampingBranch(body_when, frame.f_code, lines,
                          format_frame(filename, frame.f_lineno, frame.f_code.co_name, line or None))


def in_clamping_body(branch: ClampingBranch) -> bool:
    """Whether the op being dispatched comes from ``branch``'s body (its frame, one of its lines)."""
    frame = _user_frame()
    return frame is not None and frame.f_code is branch.code and branch.lines[0] <= frame.f_lineno <= branch.lines[1]


@functools.lru_cache(maxsize=4096)
def _clamping_body(code: types.CodeType, lasti: int) -> tuple[bool, tuple[int, int], ast.If] | None:
    found = _conditional_jump(code, lasti)
    if found is None:
        return None
    i, jump, taken = found
    if jump.positions is None or jump.positions.lineno is None:
        return None
    instructions, index = _instructions(code)
    branch = _if_around(code.co_filename, jump)
    if branch is None:
        return None
    lines = (branch.body[0].lineno, branch.body[-1].end_lineno)

    def enters(j: int | None) -> bool | None:
        while j is not None and j < len(instructions):  # the first instruction with a line
            pos = instructions[j].positions
            if pos is not None and pos.lineno is not None:
                return lines[0] <= pos.lineno <= lines[1]
            j += 1
        return None

    on_jump, on_fall = enters(index.get(jump.argval)), enters(i + 1)
    if on_jump is None or on_fall is None or on_jump == on_fall:
        return None
    return (taken if on_jump else not taken), lines, branch


def _if_around(filename: str, jump: dis.Instruction) -> ast.If | None:
    """The ``if`` (no ``else``) whose test holds ``jump`` and whose body only clamps, else None."""
    pos = jump.positions
    text = "".join(linecache.getlines(filename))
    for node in _ifs(filename, text):
        test = node.test
        if not (test.lineno <= pos.lineno <= test.end_lineno and _inside(node, jump)):
            continue
        if node.orelse or not all(_clamping_shape(s) for s in node.body):
            return None
        return node
    return None


@functools.lru_cache(maxsize=64)
def _ifs(filename: str, text: str) -> list[ast.If]:
    try:
        tree = ast.parse(text, filename)
    except (SyntaxError, ValueError):
        return []
    # innermost first: an if nested in another's test cannot happen, but in its body it can
    return sorted((n for n in ast.walk(tree) if isinstance(n, ast.If)), key=lambda n: -(n.lineno * 10**6 + n.col_offset))


def _clamping_shape(stmt: ast.stmt) -> bool:
    """``name = <call or expression>``: one plain name assigned."""
    return isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)


def _only_clamps(body: list[ast.stmt], frame) -> bool:
    """Every statement is ``x = torch.clamp(x, ...)`` / ``x = x.clamp(...)`` (the same name: on the other side
    it keeps its value) or assigns a value computed without tensors; the bounds are such values. Names are
    looked up in the frame (a tensor there, or anything not found, is not a constant) or were so assigned above."""
    constants: set[str] = set()

    def constant(expr: ast.expr) -> bool:
        for sub in ast.walk(expr):
            if isinstance(sub, ast.Call):
                if not (isinstance(sub.func, ast.Attribute) and sub.func.attr in ("finfo", "iinfo")):
                    return False
            elif not isinstance(sub, (ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator,
                                      ast.unaryop, ast.expr_context)):
                return False
        return all(_plain(chain, frame, constants) for chain in _chains(expr))

    for stmt in body:
        target, value = stmt.targets[0].id, stmt.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _CLAMPS:
            function = isinstance(value.func.value, ast.Name) and value.func.value.id == "torch"
            clamped = value.args[0] if function and value.args else value.func.value
            bounds = value.args[1:] if function else value.args
            if not (isinstance(clamped, ast.Name) and clamped.id == target):
                return False
            if not all(constant(b) for b in [*bounds, *(k.value for k in value.keywords)]):
                return False
        elif constant(value):
            constants.add(target)
        else:
            return False
    return True


def _chains(expr: ast.expr) -> list[ast.expr]:
    """The outermost name/attribute chains of ``expr`` (``torch.finfo``, ``hidden_states.dtype``, ``c``)."""
    found, stack = [], [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Name, ast.Attribute)) and _is_dotted(node):
            found.append(node)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return found


def _plain(chain: ast.expr, frame, constants: set[str]) -> bool:
    """A name/attribute chain whose value in the frame is no tensor (or a name assigned a constant above)."""
    if isinstance(chain, ast.Name) and chain.id in constants:
        return True
    try:
        value = _evaluate(chain, frame)
    except Exception:  # noqa: BLE001 - not found: not known to be plain
        return False
    return not isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
