"""The collection config, the build, loading through `kernels`, and the publish plan."""

import filecmp
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import build
import collection
import publish
import toy_kernel

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def toy_repo(tmp_path_factory):
    return toy_kernel.build_toy(tmp_path_factory.mktemp("toy-dist"))


# --------------------------------------------------------------------------------- build.toml


def test_root_collection_is_valid():
    coll = collection.load_collection()
    assert {k.hub_name for k in coll.kernels} == {
        "ragged-dot-tpu",
        "flash-attention-tpu",
        "paged-attention-tpu",
    }
    for k in coll.kernels:
        assert k.version == 1 and set(k.backends) == {"tpu", "cpu"}
        assert k.source == ROOT / "kernels" / k.key
    assert not (ROOT / "kernels" / "__init__.py").exists(), "it would shadow the kernels library"


def test_hub_org_is_written_once():
    """Only build.toml names the Hub org; packages learn their repo id from the generated _ops.py."""
    org = collection.load_collection().hub_org
    sources = [ROOT / "flake.nix", ROOT / "Makefile"]
    for folder in ("kernels", "torch-ext", "scripts", "benchmarks"):
        sources += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".toml", ".nix"}]
    hits = [p.relative_to(ROOT).as_posix() for p in sources if f"{org}/" in p.read_text()]
    assert hits == []


def _broken_config(tmp_path, edit):
    config = toy_kernel.copy_toy_collection(tmp_path / "coll")
    config.write_text(edit(config.read_text()))
    return config


@pytest.mark.parametrize(
    "edit, key",
    [
        (
            lambda t: t.replace('hub-org = "toy-org"', 'hub-org = "toy-org"\nhub_org = "x"'),
            "collection.hub_org",
        ),
        (lambda t: t.replace('license = "apache-2.0"\n', ""), "collection.license"),
        (lambda t: t.replace("version = 1", 'version = "1"'), "kernels.toy_scale.version"),
        (lambda t: t.replace("version = 1", "version = 0"), "kernels.toy_scale.version"),
        (
            lambda t: t.replace('hub-name = "toy-scale-tpu"', 'hub-name = "Toy_Scale"'),
            "kernels.toy_scale.hub-name",
        ),
        (
            lambda t: t.replace('source = "kernels/toy_scale"', 'source = "kernels/nope"'),
            "kernels.toy_scale.source",
        ),
        (
            lambda t: t.replace('backends = ["tpu", "cpu"]', 'backends = ["tpu", "cuda"]'),
            "kernels.toy_scale.backends",
        ),
        (
            lambda t: t.replace('exports = ["scale_add"]', 'exports = ["scale-add"]'),
            "kernels.toy_scale.exports",
        ),
        (lambda t: t + "\n[kernels.toy_scale.extra]\n", "kernels.toy_scale.extra"),
        (lambda t: t.replace("[collection]", "[collection]\nmystery = 1"), "collection.mystery"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, edit, key):
    config = _broken_config(tmp_path, edit)
    with pytest.raises(collection.ConfigError) as err:
        collection.load_collection(config)
    assert str(config) in str(err.value) and key in str(err.value)


def test_kernel_folder_missing_a_contract_file_is_named(tmp_path):
    config = toy_kernel.copy_toy_collection(tmp_path / "coll")
    (config.parent / "kernels" / "toy_scale" / "tiling.py").unlink()
    with pytest.raises(collection.ConfigError, match="tiling.py"):
        collection.load_collection(config)


# --------------------------------------------------------------------------------- build output


def test_build_is_byte_identical(tmp_path):
    a = toy_kernel.build_toy(tmp_path / "a")
    b = toy_kernel.build_toy(tmp_path / "b")
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    _, mismatch, errors = filecmp.cmpfiles(a, b, [str(f) for f in files_a], shallow=False)
    assert mismatch == [] and errors == []


def test_repo_layout(toy_repo):
    for rel in [
        "README.md",
        "build.toml",
        "flake.nix",
        "torch-ext/toy_scale_tpu/ops.py",
        "build/torch-tpu/__init__.py",
        "build/torch-tpu/_ops.py",
        "build/torch-tpu/jax_bridge.py",
        "build/torch-tpu/tpu_generations.py",
        "build/torch-tpu/metadata.json",
        "build/torch-cpu/metadata.json",
    ]:
        assert (toy_repo / rel).is_file(), rel
    card = (toy_repo / "README.md").read_text()
    for needle in [
        'get_kernel("toy-org/toy-scale-tpu", version=1',
        "jax",
        "torch-tpu",
        "libtpu",
        "Version 1",
    ]:
        assert needle in card


def test_generated_files_pass_the_kernels_library_parsers(toy_repo):
    from kernels._rust import Backend, Build, Digest, DigestAlgorithm, Metadata

    general = Build.open(toy_repo).general
    assert set(general.backends) == {Backend.TPU, Backend.CPU}
    ids = set()
    for variant, backend in [("torch-tpu", Backend.TPU), ("torch-cpu", Backend.CPU)]:
        path = toy_repo / "build" / variant
        meta = Metadata.read_from_file(path / "metadata.json")
        assert str(meta.name) == "toy-scale-tpu" and meta.version == 1
        assert meta.license == "apache-2.0" and meta.python_depends == []
        assert meta.backend.backend_type == backend
        meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, path))
        assert f'_OPS_NAME = "{meta.id}"' in (path / "_ops.py").read_text()
        ids.add(meta.id)
    assert len(ids) == 2  # one namespace per backend


def test_tampered_file_fails_the_digest(toy_repo, tmp_path):
    from kernels._rust import Digest, DigestAlgorithm, DigestValidationError, Metadata

    variant = tmp_path / "variant"
    shutil.copytree(toy_repo / "build" / "torch-cpu", variant)
    (variant / "kernel.py").write_text("# changed\n")
    meta = Metadata.read_from_file(variant / "metadata.json")
    with pytest.raises(DigestValidationError):
        meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))


def test_flake_files_parse(toy_repo):
    nix = shutil.which("nix-instantiate")
    if nix is None:
        raise AssertionError("nix-instantiate missing: `make setup` installs Debian's nix-bin")
    for flake in [ROOT / "flake.nix", toy_repo / "flake.nix"]:
        subprocess.run([nix, "--parse", str(flake)], check=True, capture_output=True)


# --------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("where", ["repo", "build", "variant"])
def test_get_local_kernel_accepts_every_level(toy_repo, where):
    from kernels import get_local_kernel

    path = {
        "repo": toy_repo,
        "build": toy_repo / "build",
        "variant": toy_repo / "build" / "torch-cpu",
    }[where]
    mod = get_local_kernel(path)
    x = torch.ones(8, 128)
    torch.testing.assert_close(mod.scale_add(x, x, 2.0), 3 * x)


def test_tpu_variant_is_chosen_when_torch_backends_tpu_exists(toy_repo, monkeypatch):
    from kernels import get_local_kernel

    assert "torch-cpu" in get_local_kernel(toy_repo).__file__
    monkeypatch.setattr(
        torch.backends, "tpu", types.ModuleType("torch.backends.tpu"), raising=False
    )
    mod = get_local_kernel(toy_repo)
    assert "torch-tpu" in mod.__file__
    assert mod._ops._OPS_NAME.startswith("_toy_scale_tpu_tpu_")
    x = torch.ones(8, 128)  # a CPU tensor still runs, in interpret mode
    torch.testing.assert_close(mod.scale_add(x, x, 1.0), 2 * x)


def test_local_kernels_override(toy_repo, monkeypatch):
    from kernels import get_kernel

    monkeypatch.setenv("LOCAL_KERNELS", f"toy-org/toy-scale-tpu={toy_repo}")
    mod = get_kernel("toy-org/toy-scale-tpu", version=1)
    x = torch.ones(8, 128)
    torch.testing.assert_close(mod.scale_add(x, x, 4.0), 5 * x)


def _offline_script(cache: Path, body: str) -> subprocess.CompletedProcess:
    # The built package must load from the cache alone: the repository's module folders (on the
    # dev venv's path through its .pth, Makefile REPO_PATHS) leave the path first.
    code = (
        "import os, sys\nfrom pathlib import Path\n"
        f"root = Path({str(ROOT)!r})\n"
        "sys.path[:] = [p for p in sys.path "
        "if not (Path(p).parent == root and not Path(p).name.startswith('.'))]\n"
        "os.environ['HF_HUB_OFFLINE'] = '1'\n"
        f"os.environ['HF_HUB_CACHE'] = {str(cache)!r}\n"
        "import torch\nfrom kernels import get_kernel\n" + body
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_offline_get_kernel_from_the_built_cache(toy_repo):
    cache = toy_repo.parent / "hub-cache"
    sha = (cache / "kernels--toy-org--toy-scale-tpu" / "refs" / "v1").read_text()
    assert (
        cache
        / "kernels--toy-org--toy-scale-tpu"
        / "snapshots"
        / sha
        / "build"
        / "torch-cpu"
        / "metadata.json"
    ).is_file()
    run = _offline_script(
        cache,
        (
            "k = get_kernel('toy-org/toy-scale-tpu', version=1, trust_remote_code=True)\n"
            "x = torch.ones(8, 128)\n"
            "print(float(k.scale_add(x, x, 2.0).sum()), k.__file__)\n"
        ),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    total, path = run.stdout.split()
    assert float(total) == 3 * 8 * 128 and sha in path


def test_offline_get_kernel_unknown_version_gives_the_library_error(toy_repo):
    run = _offline_script(
        toy_repo.parent / "hub-cache",
        (
            "try:\n"
            "    get_kernel('toy-org/toy-scale-tpu', version=2, trust_remote_code=True)\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "else:\n"
            "    print('LOADED')\n"
        ),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ValueError Version 2 not found, available versions: 1" in run.stdout, run.stdout


def test_two_builds_from_different_sources_load_side_by_side(tmp_path):
    from kernels import get_local_kernel

    config_a = toy_kernel.copy_toy_collection(tmp_path / "a")
    config_b = toy_kernel.copy_toy_collection(tmp_path / "b")
    kernel_b = config_b.parent / "kernels" / "toy_scale" / "kernel.py"
    kernel_b.write_text(
        kernel_b.read_text().replace("o_ref[...] = (scale *", "o_ref[...] = (2 * scale *")
    )  # version B doubles the scale
    repo_a = toy_kernel.build_toy(tmp_path / "dist-a", config_a)
    repo_b = toy_kernel.build_toy(tmp_path / "dist-b", config_b)
    mod_a = get_local_kernel(repo_a / "build" / "torch-cpu")
    mod_b = get_local_kernel(repo_b / "build" / "torch-cpu")
    assert mod_a._ops._OPS_NAME != mod_b._ops._OPS_NAME
    x = torch.ones(8, 128)
    torch.testing.assert_close(mod_a.scale_add(x, x, 1.0), 2 * x)
    torch.testing.assert_close(mod_b.scale_add(x, x, 1.0), 3 * x)
    torch.testing.assert_close(mod_a.scale_add(x, x, 1.0), 2 * x)  # A is still A


def test_real_kernels_build_and_export_what_build_toml_declares():
    import kernel_loader

    coll = collection.load_collection()
    for entry in coll.kernels:
        mod = kernel_loader.load_kernel(entry.key)
        missing = [name for name in entry.exports if not callable(getattr(mod, name, None))]
        assert missing == [], f"{entry.hub_name} lacks {missing}"
        assert set(entry.exports) <= set(mod.__all__)


# --------------------------------------------------------------------------------- publish


def test_publish_dry_run_plan(toy_repo, capsys):
    config = toy_kernel.TOY_CONFIG
    ops = publish.plan(toy_repo.parent, config=config)
    assert [(o.verb, o.revision) for o in ops] == [
        ("create_repo", None),
        ("upload_file", "main"),
        ("create_branch", "v1"),
        ("upload_folder", "v1"),
    ]
    assert ops[1].path_in_repo == "README.md"
    assert ops[3].path_in_repo == "build" and ops[3].delete_patterns == ("*",)
    assert all(o.repo_id == "toy-org/toy-scale-tpu" for o in ops)
    assert publish.main(["--dist", str(toy_repo.parent), "--config", str(config), "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(ops) and all(line.startswith("[dry-run]") for line in printed)


def test_publish_without_token_stops_before_any_operation(toy_repo, monkeypatch, capsys):
    monkeypatch.setattr(publish, "find_token", lambda: None)
    monkeypatch.setattr(publish, "execute", lambda *a: pytest.fail("must not upload"))
    code = publish.main(["--dist", str(toy_repo.parent), "--config", str(toy_kernel.TOY_CONFIG)])
    assert code == 2 and "token" in capsys.readouterr().err


def test_publish_refuses_an_unbuilt_dist(tmp_path):
    with pytest.raises(publish.PublishError, match="scripts/build.py"):
        publish.plan(tmp_path, config=toy_kernel.TOY_CONFIG)


# --------------------------------------------------------------------------------- kernel cards


def _results_row(kernel, shape, impl, per_generation):
    return {
        "kernel": kernel,
        "shape": shape,
        "impl": impl,
        "label": f"label of {impl}",
        "per_generation": per_generation,
    }


def test_cards_show_our_times_beside_the_anchors_from_results_json():
    coll = collection.load_collection()
    results = build.load_results(coll)
    assert results is not None, "benchmarks/results/results.json is committed"
    for entry in coll.kernels:
        card = build.kernel_card(coll, entry)
        rows = [r for r in results["named"]["rows"] if r["kernel"] == entry.key]
        assert rows, entry.key
        section = card.split("## Performance\n", 1)[1].split("\n## ", 1)[0]
        assert "make bench" in section and "python benchmarks/run.py" in section
        assert (
            "Scheduled, not measured on a TPU" in section
            or "Not measured on a TPU" in section
            or 'Cells without "measured" are not measured on a TPU' in section
        )
        table = [line for line in section.splitlines() if line.startswith("| ")]
        assert table[0] == "| shape | implementation | v5e | v6e | tpu7x |"
        assert len(table) == 1 + len(rows)  # header + one line per implementation and shape
        for row in rows:
            cells = [build.perf_cell(row["per_generation"][g])[0] for g in ("v5e", "v6e", "tpu7x")]
            if row["impl"] == "ours":
                cells = [f"**{c}**" for c in cells]
            assert f"| {row['label']} | " + " | ".join(cells) + " |" in section, row["shape"]


def test_performance_cell_prefers_measured_then_scheduled_then_the_model():
    base = {"modelled_us": 664.3, "compile": {"compiles": True}}
    assert build.perf_cell(base) == ("≥ 664", "model")
    sched = dict(
        base, scheduled={"scheduled_us": 1502.4, "hot_mxu_occupancy": 0.31, "bound": "VALU"}
    )
    assert build.perf_cell(sched) == ("1,502 (MXU 31%, bound: VALU)", "scheduled")
    as_percent = dict(base, scheduled={"scheduled_us": 80.0, "hot_mxu_occupancy": 31.0})
    assert build.perf_cell(as_percent) == ("80.0 (MXU 31%)", "scheduled")
    assert build.perf_cell(dict(sched, measured_us=1490.0)) == ("1,490 measured", "measured")
    assert (
        build.perf_cell({"modelled_us": 5.0, "compile": {"compiles": False}})[0]
        == "does not compile"
    )
    # a schedule without a time (compile dump failed, hot-loop work not modelled): the model stands
    for broken in ({"error": "no dump"}, {"scheduled_us": None, "bound": "MXU"}):
        assert build.perf_cell(dict(base, scheduled=broken)) == ("≥ 664", "model")
    assert build.perf_cell(None) == ("n/a", "none")


def test_performance_section_wording_follows_what_the_numbers_are():
    model = {"modelled_us": 100.0}
    sched = {
        "modelled_us": 100.0,
        "scheduled": {"scheduled_us": 250.0, "hot_mxu_occupancy": 0.5, "bound": "MXU"},
    }
    only_model = {"named": {"rows": [_results_row("k", "s", "ours", {"v6e": model})]}}
    text = build.performance_section("k", only_model)
    assert "Not measured on a TPU" in text and "roofline model" in text
    assert "Scheduled, not measured" not in text and "| v6e |" in text and "| v5e |" not in text
    mixed = {
        "named": {
            "rows": [
                _results_row("k", "s", "anchor:a", {"v6e": model}),
                _results_row("k", "s", "ours", {"v6e": sched}),
            ]
        }
    }
    text = build.performance_section("k", mixed)
    assert "**Scheduled, not measured on a TPU**" in text and "≥ 100" in text
    ours_line = text.index("| `s` | label of ours | **250 (MXU 50%, bound: MXU)** |")
    assert ours_line < text.index("| label of anchor:a | ≥ 100 |")  # ours first
    assert build.performance_section("other", mixed) == ""
    assert build.performance_section("k", None) == ""


def test_cards_with_results_are_byte_identical(tmp_path):
    results = {
        "meta": {"jax": "0"},
        "named": {
            "rows": [
                _results_row("toy_scale", "tiny", "anchor:xla", {"v5e": {"modelled_us": 3.25}}),
                _results_row(
                    "toy_scale",
                    "tiny",
                    "ours",
                    {
                        "v5e": {
                            "modelled_us": 1.5,
                            "scheduled": {
                                "scheduled_us": 2.0,
                                "hot_mxu_occupancy": 0.9,
                                "bound": "DMA",
                            },
                        }
                    },
                ),
            ]
        },
    }
    repos = []
    for name in ("a", "b"):
        config = toy_kernel.copy_toy_collection(tmp_path / f"coll-{name}")
        path = config.parent / build.RESULTS_JSON
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(results))
        repos.append(toy_kernel.build_toy(tmp_path / f"dist-{name}", config))
    card = (repos[0] / "README.md").read_bytes()
    assert card == (repos[1] / "README.md").read_bytes()
    assert "## Performance" in card.decode() and "**2.0 (MXU 90%, bound: DMA)**" in card.decode()


def test_tested_with_entries_name_what_their_tests_run():
    for key, entries in build.TESTED_WITH.items():
        collection.load_collection().kernel(key)
        for path, needle, _ in entries:
            assert needle in (ROOT / path).read_text(), f"{path} no longer holds {needle!r}"
        card = build.kernel_card(
            collection.load_collection(), collection.load_collection().kernel(key)
        )
        assert "## Tested with" in card


def test_pinned_flash_models_match_the_installed_transformers():
    """The card and README list the models whose class pins `_compatible_flash_implementations`."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    pinning = {
        p.parent.name
        for p in models.glob("*/modeling_*.py")
        if "_compatible_flash_implementations = " in p.read_text()
    }
    assert pinning == set(build.PINNED_FLASH_MODELS)


def test_flash_card_gives_the_registered_name_path_for_pinned_models():
    import re

    coll = collection.load_collection()
    card = build.kernel_card(coll, coll.kernel("flash_attention"))
    integration = (ROOT / "kernels" / "flash_attention" / "integration.py").read_text()
    default_name = re.search(r'^DEFAULT_NAME = "([^"]+)"', integration, re.M).group(1)
    assert "flash" not in default_name
    assert f'name = kernel.register()   # "{default_name}"' in card
    assert "attn_implementation=name" in card
    for model in build.PINNED_FLASH_MODELS.values():
        assert model in card
    for entry in coll.kernels:
        if entry.key != "flash_attention":
            assert "_compatible_flash_implementations" not in build.kernel_card(coll, entry)


def test_license_file_matches_build_toml_and_ships_in_every_repo(tmp_path):
    """LICENSE at the root is the text of the license build.toml declares, and each built Hub repo
    carries it."""
    coll = collection.load_collection()
    text = (ROOT / "LICENSE").read_text()
    assert coll.license == "apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    repo = build.build_repo(coll, coll.kernels[0], tmp_path)
    assert (repo / "LICENSE").read_text() == text
