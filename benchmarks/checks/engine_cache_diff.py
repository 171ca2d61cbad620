"""What differs between two engine caches (engines/levers/cache.py): their keys, and per key and rank the compiler
artifacts torch saved (FX graphs, autotuning results, ...), artifact by artifact.

    python -m benchmarks.checks.engine_cache_diff CACHE_A CACHE_B --out diff.json

Made to find why an image served from a cache that `build` filled differs from one served after compiling
at the first request (benchmarks/checks/acceptance.py): another key means other inputs; the same key with
other generated code (an inductor graph's source) means the two compiles made other kernels; the same code
with other Triton configurations chosen at run time (the `*.best_config` files inductor keeps in its kernel
cache, <cache>/inductor: not part of the artifacts) means autotuning by timing picked differently, which
changes the order of a reduction's sums. Artifacts are compared by what they compute: an inductor graph by
its generated source (a unified diff when it differs), an AOTAutograd wrapper not at all (it differs in
compile times only), anything else byte for byte (text shown up to 4000 characters).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import torch


def artifacts(data: bytes) -> dict[str, str | bytes]:
    """"type/key" -> content of every artifact in one rank's file (torch's cache-artifact format);
    {"<unreadable>": error} when this torch cannot read it."""
    try:
        from torch.compiler._cache import AppendingByteSerializer, CacheArtifactManager, _deserialize_single_cache

        CacheArtifactManager._ensure_cache_artifacts_registered()
        entries = AppendingByteSerializer.to_list(data, deserialize_fn=_deserialize_single_cache)
    except Exception as error:  # a private format that changes between torch versions
        return {"<unreadable>": repr(error)}
    return {f"{kind}/{artifact.key}": artifact.content for kind, items in entries for artifact in items}


def describe(content: str | bytes) -> dict[str, Any]:
    """Size and hash of an artifact, and its text when it is short text."""
    raw = content.encode() if isinstance(content, str) else content
    out: dict[str, Any] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()[:16]}
    try:
        text = raw.decode()
        if len(text) <= 4000:
            out["text"] = text
    except UnicodeDecodeError:
        pass
    return out


def computed(content: str | bytes) -> str | bytes | None:
    """What an artifact computes: an inductor graph's generated source, None for an AOTAutograd wrapper (its
    bytes differ between identical compiles: compile times), else the content itself."""
    try:
        loaded = pickle.loads(content)
    except Exception:  # not a pickle: compared as it is
        return content
    if type(loaded).__name__ == "AOTAutogradResult":
        return None
    source = getattr(loaded, "source_code", None)
    return source if isinstance(source, str) else content


def source_diff(a: str, b: str, limit: int = 300) -> list[str]:
    """The first `limit` lines of a unified diff of two generated sources."""
    return list(difflib.unified_diff(a.splitlines(), b.splitlines(), "a", "b", lineterm="", n=2))[:limit]


def best_configs(root: Path) -> dict[str, str]:
    """Kernel file name -> the Triton configuration inductor chose for it by timing (under root/inductor)."""
    return {path.name: path.read_text(errors="replace") for path in sorted((root / "inductor").rglob("*.best_config"))}


def cache_entries(root: Path) -> dict[str, dict[str, Any]]:
    """key -> {"doc": key.json, "ranks": {rank file: artifacts}} of one cache folder."""
    found = {}
    for doc in sorted(root.glob("*/key.json")):
        ranks = {path.name: artifacts(path.read_bytes()) for path in sorted(doc.parent.glob("rank*.bin"))}
        found[doc.parent.name] = {"doc": json.loads(doc.read_text()), "ranks": ranks}
    return found


def diff_docs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The top-level fields of two key documents that differ."""
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def compare(a_root: Path, b_root: Path) -> dict[str, Any]:
    """The differences between two caches (see the module docstring)."""
    a, b = cache_entries(a_root), cache_entries(b_root)
    report: dict[str, Any] = {"a": str(a_root), "b": str(b_root), "torch": torch.__version__,
                              "keys_only_in_a": {k: a[k]["doc"] for k in sorted(set(a) - set(b))},
                              "keys_only_in_b": {k: b[k]["doc"] for k in sorted(set(b) - set(a))},
                              "shared_keys": {}}
    for key in sorted(set(a) & set(b)):
        entry: dict[str, Any] = {"doc_differences": diff_docs(a[key]["doc"], b[key]["doc"]), "ranks": {}}
        for rank in sorted(set(a[key]["ranks"]) | set(b[key]["ranks"])):
            left, right = a[key]["ranks"].get(rank, {}), b[key]["ranks"].get(rank, {})
            entry["ranks"][rank] = {
                "artifacts": [len(left), len(right)],
                "only_in_a": {name: describe(left[name]) for name in sorted(set(left) - set(right))},
                "only_in_b": {name: describe(right[name]) for name in sorted(set(right) - set(left))},
                "differing": {},
                "equal": 0,
                "wrappers_not_compared": 0,
            }
            for name in sorted(set(left) & set(right)):
                ours, theirs = computed(left[name]), computed(right[name])
                if ours is None:
                    entry["ranks"][rank]["wrappers_not_compared"] += 1
                elif ours == theirs:
                    entry["ranks"][rank]["equal"] += 1
                elif isinstance(ours, str) and isinstance(theirs, str):
                    entry["ranks"][rank]["differing"][name] = {"source_diff": source_diff(ours, theirs)}
                else:
                    entry["ranks"][rank]["differing"][name] = [describe(left[name]), describe(right[name])]
        report["shared_keys"][key] = entry
    a_configs, b_configs = best_configs(a_root), best_configs(b_root)
    shared = set(a_configs) & set(b_configs)
    report["best_configs"] = {
        "kernels": [len(a_configs), len(b_configs)], "shared": len(shared),
        "same": sum(1 for name in shared if a_configs[name] == b_configs[name]),
        "differing": {name: [a_configs[name], b_configs[name]] for name in sorted(shared)
                      if a_configs[name] != b_configs[name]},
    }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here (else print it)")
    args = parser.parse_args(argv)
    text = json.dumps(compare(args.a, args.b), indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
