"""Upload built kernel repos (from scripts/build.py) to the Hugging Face Hub.

    python scripts/publish.py [--dist dist] [--kernel ragged-dot-tpu ...] [--dry-run]

For each kernel, as kernel-builder's `upload` does:
  1. create the repo `<org>/<hub-name>` with repo_type "kernel" (if it does not exist);
  2. upload the kernel card as README.md on branch `main`;
  3. create branch `v<version>` and upload `build/` and `benchmarks/` to it, deleting files there
     that the new build no longer has (stale variants, renamed modules).
`--dry-run` prints every operation and touches nothing. Without a token (HF_TOKEN or a saved
login) it stops with a clear message before any operation.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from collection import load_collection

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Operation:
    verb: str  # create_repo | upload_file | create_branch | upload_folder
    repo_id: str
    revision: str | None = None
    path: str | None = None  # local path
    path_in_repo: str | None = None
    delete_patterns: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [self.verb, self.repo_id, "repo_type=kernel"]
        if self.revision:
            parts.append(f"revision={self.revision}")
        if self.path:
            parts.append(f"{self.path} -> {self.path_in_repo or '.'}")
        if self.delete_patterns:
            parts.append("delete_patterns=" + ",".join(self.delete_patterns))
        return " ".join(parts)


class PublishError(RuntimeError):
    pass


def plan(dist: Path, only: list[str] | None = None, config: Path | None = None) -> list[Operation]:
    """The operations that publish the built repos in `dist`, in order."""
    coll = load_collection(config)
    entries = [coll.kernel(k) for k in only] if only else list(coll.kernels)
    ops: list[Operation] = []
    for entry in entries:
        repo = dist / entry.hub_name
        if not (repo / "build").is_dir() or not (repo / "README.md").is_file():
            raise PublishError(
                f"{repo} is not a built kernel repo: run `python scripts/build.py` first"
            )
        repo_id = coll.repo_id(entry)
        branch = f"v{entry.version}"
        ops.append(Operation("create_repo", repo_id))
        ops.append(Operation("upload_file", repo_id, "main", str(repo / "README.md"), "README.md"))
        ops.append(Operation("create_branch", repo_id, branch))
        for sub in ("build", "benchmarks"):
            if (repo / sub).is_dir():
                # Replace the folder's content wholesale: anything not in this build is removed.
                ops.append(
                    Operation("upload_folder", repo_id, branch, str(repo / sub), sub, ("*",))
                )
    return ops


def execute(ops: list[Operation], token: str) -> None:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    for op in ops:
        print(op.describe(), flush=True)
        if op.verb == "create_repo":
            api.create_repo(op.repo_id, repo_type="kernel", exist_ok=True)
        elif op.verb == "upload_file":
            api.upload_file(
                path_or_fileobj=op.path,
                path_in_repo=op.path_in_repo,
                repo_id=op.repo_id,
                repo_type="kernel",
                revision=op.revision,
                commit_message="Update kernel card",
            )
        elif op.verb == "create_branch":
            api.create_branch(op.repo_id, branch=op.revision, repo_type="kernel", exist_ok=True)
        elif op.verb == "upload_folder":
            api.upload_folder(
                folder_path=op.path,
                path_in_repo=op.path_in_repo,
                repo_id=op.repo_id,
                repo_type="kernel",
                revision=op.revision,
                delete_patterns=list(op.delete_patterns),
                ignore_patterns=["**/__pycache__/**", "*.pyc"],
                commit_message=f"Upload {op.path_in_repo}/",
            )
        else:  # pragma: no cover - plan() makes only the verbs above
            raise PublishError(f"unknown operation {op.verb}")


def find_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    parser.add_argument("--kernel", action="append", help="hub name or key; default: all")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the operations only")
    args = parser.parse_args(argv)
    try:
        ops = plan(args.dist, args.kernel, args.config)
    except PublishError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for op in ops:
            print("[dry-run]", op.describe())
        return 0
    token = find_token()
    if not token:
        print(
            "error: no Hugging Face token: set HF_TOKEN or run `hf auth login` "
            "(nothing was uploaded)",
            file=sys.stderr,
        )
        return 2
    execute(ops, token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
