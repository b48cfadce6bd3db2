"""The numbers README.md states, checked against their sources so they cannot drift: the test
count against `pytest --collect-only`, every ratio and step count a sentence quotes with
"(`benchmarks/results`)" against benchmarks/results/results.json, and the list of models that pin
their flash kernels against the one the kernel card is built from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import build

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())

# Helpers add and remove tests between README updates; beyond this the README line is stale.
TEST_COUNT_SLACK = 0.15
CITATION = "(`benchmarks/results`)"


def test_readme_test_count_matches_the_collected_suite():
    stated = re.findall(r"~(\d+) tests", README)
    assert len(stated) == 1, "README states the suite size once, as '~N tests'"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    found = re.search(r"^(\d+) tests? collected", run.stdout, re.M)
    assert found, run.stdout[-2000:] + run.stderr[-2000:]
    collected, readme = int(found.group(1)), int(stated[0])
    assert abs(collected - readme) <= TEST_COUNT_SLACK * readme, (
        f"README says ~{readme} tests, pytest collects {collected}: update the `make test` line "
        "(and its time, from the last full run)"
    )


def _cited_sentences(text: str) -> list[str]:
    """Every sentence that ends by citing `benchmarks/results`."""
    parts = re.sub(r"\s+", " ", text).split(CITATION)[:-1]
    return [re.split(r"(?<=\.) (?=[-A-Z`])", part)[-1] + CITATION for part in parts]


def _quoted_numbers(sentence: str) -> list[tuple[str, str]]:
    """(kind, token) pairs: ratios such as "1.26x" and step counts such as "80 grid steps"."""
    ratios = [("ratio", m) for m in re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)x\b", sentence)]
    steps = [("steps", m) for m in re.findall(r"(?<![\w.])(\d[\d,.]*k?) (?:grid )?steps", sentence)]
    return ratios + steps


def _result_values() -> dict[str, dict[str, list[float]]]:
    """Per kernel, the ratios and step counts results.json holds for its real-model shapes: bytes
    over the minimum, issued over useful MXU work, grid steps. A sentence is checked against one
    kernel's values, which keeps a stale number from matching some unrelated row."""
    values: dict[str, dict[str, list[float]]] = {}
    for r in RESULTS["named"]["rows"]:
        v = values.setdefault(r["kernel"], {"ratio": [], "steps": []})
        v["ratio"] += [r["hbm_bytes"] / r["min_hbm_bytes"], r["mxu_flops"] / r["useful_flops"]]
        v["steps"].append(r["grid_steps"])
    return values


def _matches(kind: str, token: str, values: list[float]) -> bool:
    scale = 1000 if token.endswith("k") else 1
    digits = token.rstrip("k").replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    target, half_unit = float(digits), 0.5 * 10**-decimals
    return any(abs(v / scale - target) <= half_unit + 1e-9 for v in values)


def _unmatched(sentence: str, values) -> list[str]:
    """The sentence's quoted numbers that no single kernel's results hold (fewest over kernels)."""
    tokens = _quoted_numbers(sentence)
    misses = [[t for k, t in tokens if not _matches(k, t, v[k])] for v in values.values()]
    return min(misses, key=len)


def test_readme_numbers_quoted_from_results_are_in_results_json():
    values = _result_values()
    checked, wrong = 0, []
    for sentence in _cited_sentences(README):
        checked += len(_quoted_numbers(sentence))
        wrong += [f"{t} in: {sentence[:160]}..." for t in _unmatched(sentence, values)]
    assert checked > 0, f"no number found in sentences citing {CITATION}"
    assert wrong == [], (
        "README quotes numbers results.json does not hold (rerun of make bench?):\n"
        + "\n".join(wrong)
    )


def test_quote_checker_catches_a_stale_number():
    values = _result_values()
    current = (
        "This moves 1.26x the minimum in 80 grid steps (Splash: 8.35x, 8.19k steps) " + CITATION
    )
    assert _quoted_numbers(current) == [
        ("ratio", "1.26"),
        ("ratio", "8.35"),
        ("steps", "80"),
        ("steps", "8.19k"),
    ]
    assert _unmatched(current, values) == []
    stale = current.replace("1.26x", "1.31x").replace("80 grid", "83 grid")
    assert _unmatched(stale, values) == ["1.31", "83"]


def test_readme_lists_the_models_that_pin_flash_kernels_and_the_registered_name_path():
    flat = re.sub(r"\s+", " ", README)
    for model in build.PINNED_FLASH_MODELS.values():
        assert model in flat, model
    integration = (ROOT / "kernels" / "flash_attention" / "integration.py").read_text()
    default_name = re.search(r'^DEFAULT_NAME = "([^"]+)"', integration, re.M).group(1)
    assert re.search(rf'name = kernel\.register\(\)\s+# "{re.escape(default_name)}"', README)
    assert "attn_implementation=name" in README
