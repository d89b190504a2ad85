"""The engine's two roles: every engine class implements the protocols it claims (method names, parameter names and
kinds, extra parameters only with defaults), and a bridge calls nothing on an engine but ``WeightTarget`` (LoRA:
``LoRATarget``) members, the loop's rollout side nothing but ``Sampler`` members.

Classes are read from their source with ``ast`` (the SGLang engine's module imports sglang, minutes on a busy
machine); the protocols are imported. Needs: CPU, 1 process, no sglang (< 5 s)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megaflow.bridge.base import WeightTarget
from megaflow.bridge.lora import LoRATarget
from megaflow.rollout.engine import RolloutEngine, Sampler

PACKAGE = Path(__file__).resolve().parents[2] / "megaflow"
KINDS = {"args": inspect.Parameter.POSITIONAL_OR_KEYWORD, "kwonlyargs": inspect.Parameter.KEYWORD_ONLY}


def members(protocol) -> dict[str, inspect.Signature | None]:
    """The protocol's methods (name -> signature) and attributes (name -> None), its bases' included."""
    out: dict[str, inspect.Signature | None] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False):
            continue
        out.update({name: None for name in getattr(cls, "__annotations__", {})})
        out.update({name: inspect.signature(f) for name, f in vars(cls).items()
                    if inspect.isfunction(f) and not name.startswith("_")})
    return out


def class_methods(path: str, name: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse((PACKAGE / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def mismatches(protocol, path: str, name: str) -> list[str]:
    """What ``name`` (in ``megaflow/<path>``) lacks of ``protocol``: missing methods, parameters of another name
    or kind, extra parameters without a default."""
    methods, wrong = class_methods(path, name), []
    for member, signature in members(protocol).items():
        if signature is None:  # an attribute (engine_id): set in __init__
            if f"self.{member}" not in ast.unparse(methods["__init__"]):
                wrong.append(f"{member}: not set in __init__")
            continue
        if member not in methods:
            wrong.append(f"{member}: missing")
            continue
        args = methods[member].args
        have = {a.arg: (kind, a) for kind in KINDS for a in getattr(args, kind)}
        defaults = {a.arg for a in args.args[len(args.args) - len(args.defaults):]}
        defaults |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
        want = {p.name: p for p in list(signature.parameters.values())[1:]}
        for pname, p in want.items():
            if pname not in have or KINDS[have[pname][0]] != p.kind:
                wrong.append(f"{member}({pname}): missing or of another kind")
        extra = sorted(a for a in have if a != "self" and a not in want and a not in defaults)
        wrong += [f"{member}({a}): extra parameter without a default" for a in extra]
    return wrong


IMPLEMENTATIONS = [
    (RolloutEngine, "rollout/sglang/engine.py", "SGLangEngine"),
    (LoRATarget, "rollout/sglang/engine.py", "SGLangEngine"),
    (RolloutEngine, "rollout/baseline.py", "DiffusersEngine"),
    (RolloutEngine, "rollout/balancer.py", "Balancer"),
    (LoRATarget, "rollout/balancer.py", "Balancer"),
    (WeightTarget, "bridge/target.py", "ModuleTarget"),
]


@pytest.mark.parametrize("protocol,path,name", IMPLEMENTATIONS, ids=lambda v: getattr(v, "__name__", v))
def test_engine_classes_implement_their_protocols(protocol, path, name):
    assert not mismatches(protocol, path, name)


def test_a_mismatch_is_found():
    assert mismatches(Sampler, "bridge/target.py", "ModuleTarget")[0] == "generate: missing"
    wrong = mismatches(LoRATarget, "bridge/target.py", "ModuleTarget")
    assert wrong == ["update_lora: missing"], wrong  # the weight-target members all there


def test_the_roles_split_the_engine():
    sampler, target = set(members(Sampler)), set(members(WeightTarget))
    assert sampler & target == {"engine_id"}, sampler & target
    assert {"generate", "submit", "release", "resume", "health", "shutdown"} <= sampler
    assert {"load_bucket", "update_weights", "update_weights_from_disk", "verify_weights", "checksum"} <= target
    assert set(members(RolloutEngine)) == sampler | target


def called_on(path: Path, names: set[str]) -> set[str]:
    """The attributes read in ``path`` off a plain name in ``names`` (``engine.load_bucket``, ``e.release()``) or
    off an element of ``self.engines`` / ``self.local`` (``self.local.submit``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in names:
            found.add(node.attr)
        elif isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self" \
                and owner.attr == "local":
            found.add(node.attr)
    return found


def test_bridges_call_only_weight_target_members():
    lora = set(members(LoRATarget))
    for path in sorted((PACKAGE / "bridge").glob("*.py")):
        used = called_on(path, {"engine", "e", "target"})
        allowed = lora if path.name == "lora.py" else set(members(WeightTarget))
        assert used <= allowed, f"{path.name} calls {sorted(used - allowed)} on an engine, not a weight-target member"
    assert "load_bucket" in called_on(PACKAGE / "bridge" / "shared_memory.py", {"engine", "e"})  # the scan sees calls


def test_the_rollout_side_calls_only_sampler_members():
    used = called_on(PACKAGE / "rollout" / "hosted.py", {"e", "rollout"}) \
        | called_on(PACKAGE / "run" / "phases.py", {"e"})
    assert {"submit", "shutdown", "release", "resume"} <= used, used  # the scan sees calls
    extra = {"metrics"}  # a Balancer's counters, read only when the engine has them
    assert used <= set(members(Sampler)) | extra, sorted(used - set(members(Sampler)))
