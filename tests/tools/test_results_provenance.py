"""Every result the repository keeps can be traced: each line of benchmarks/results/ carries its
commit, time, host and versions (benchmarks/results_log.py writes them), every commit that a
result line or a document cites is in the repository's history, and the README stays a page a
newcomer reads (measurements live in docs/performance.md)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = ("commit", "time", "host", "versions")
# The fields of a result line that name a commit ("git_sha" may say "+dirty" after the sha).
COMMIT_FIELDS = ("commit", "git_sha", "git")
SHA = re.compile(r"[0-9a-f]{7,40}")
# A sha in a document: 7 to 40 hex digits in backticks, alone or before a space or a "+".
DOC_SHA = re.compile(r"`([0-9a-f]{7,40})(?:[ +][^`]*)?`")
README_MAX_LINES = 300


def result_lines() -> list[tuple[str, int, dict]]:
    found = []
    for path in sorted(RESULTS.rglob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found.append((f"{path.relative_to(ROOT)}:{n}", n, json.loads(line)))
    return found


def test_every_result_line_carries_its_provenance():
    lines = result_lines()
    assert len(lines) > 100  # the results are there to be checked
    missing = [f"{where}: {[k for k in PROVENANCE if not rec.get(k)]}"
               for where, _, rec in lines if not all(rec.get(k) for k in PROVENANCE)]
    assert not missing, missing[:20]


def _git_commits(shas: set[str]) -> set[str]:
    """The shas of `shas` that name no commit of this checkout's history."""
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True,
                         text=True, input="".join(f"{s}^{{commit}}\n" for s in sorted(shas)),
                         check=True).stdout.splitlines()
    return {s for s, line in zip(sorted(shas), out) if line.endswith("missing")
            or " ambiguous" in line}


def test_every_cited_commit_is_in_the_history():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an sdist or a copied tree): no history to check against")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone: the history the results cite is not here")
    cited: dict[str, str] = {}
    for where, _, rec in result_lines():
        for key in COMMIT_FIELDS:
            m = SHA.match(rec.get(key) or "") if isinstance(rec.get(key), str) else None
            if m:
                cited.setdefault(m.group(0), f"{where} ({key})")
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in DOC_SHA.finditer(doc.read_text()):
            cited.setdefault(m.group(1), str(doc.relative_to(ROOT)))
    assert len(cited) > 20
    missing = _git_commits(set(cited))
    assert not missing, {s: cited[s] for s in sorted(missing)}


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md: {len(lines)} lines"


def test_the_writer_gives_each_line_its_provenance(tmp_path):
    spec = importlib.util.spec_from_file_location("results_log",
                                                  ROOT / "benchmarks" / "results_log.py")
    results_log = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_log)
    out = tmp_path / "bench.jsonl"
    results_log.append_results(out, {"bench": "a", "host": {"device": "TPU v6 lite"}})
    results_log.append_results(out, [{"bench": "b", "time": "2026-01-01T00:00:00+00:00",
                                      "host": "vm", "versions": {"torch": "2.13.0"}}])
    a, b = map(json.loads, out.read_text().splitlines())
    for rec in (a, b):
        assert all(rec.get(k) for k in PROVENANCE), rec
        assert rec["versions"]["jax"] and rec["host"]["cores"] >= 1
    assert a["host"]["device"] == "TPU v6 lite" and a["host"]["cpu"]  # the record's own adds
    assert b["host"]["label"] == "vm" and b["versions"]["torch"] == "2.13.0"
    assert b["time"] == "2026-01-01T00:00:00+00:00"  # a record's own time is kept
    if (ROOT / ".git").exists() and shutil.which("git"):
        assert SHA.fullmatch(a["commit"]) and not _git_commits({a["commit"]})
