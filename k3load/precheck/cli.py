"""`k3load precheck`: check a deployment against a recipe and write DIR/compat.json.

    k3load precheck --recipe recipes/kimi-k3.yaml --base-url http://10.0.0.5:8000 \
        --container-info collect-env.txt --host-inventory n01.json --host-inventory n02.json \
        --startup-log vllm-startup.log --image vllm/vllm-openai:kimi-k3 --out runs/r1
    # a multi-node K3: each node's startup log and collect-env, NODE as its host inventory names it
    k3load precheck ... --host-inventory n01.json --host-inventory n02.json \
        --startup-log n01=n01.log --startup-log n02=n02.log --container-info n01=n01-env.txt ...

Exit status: 0 pass, 1 fail, 2 inconclusive (nothing failed, but a rule could not decide), 3 the
precheck could not run (invalid recipe, missing input file, an input file that is not its format, a
malformed NODE=PATH or a NODE no --host-inventory names: one line on stderr naming the option, or the
file, line and field; formats in docs/running.md). argparse's
own usage errors also exit 2, before anything is written: read DIR/compat.json, not only the exit
status, when that matters.
The bearer key comes from $K3_API_KEY (or --api-key); it is sent as a header and never written, nor
are the values of --header (a gateway's token; `--header @FILE` reads one a line, and $K3_HEADER is read
when no --header is given, so that no value shows in ps). --ca-bundle PEM trusts a private CA for an
https target; --insecure turns verification off.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from k3load.client.access import Secrets, Tls, access_headers, access_problem, add_access_arguments
from k3load.client.origin import plain_http_warning
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.precheck import EvidenceFormatError, PrecheckError, RecipeError, recheck, run_precheck
from k3load.precheck.node_files import NodeFilesAction
from k3load.precheck.report import COMPAT, summary_lines
from k3load.yamlfile import one_line

EXIT = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
EXIT_ERROR = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", type=Path, help="recipe YAML, required (recipes/kimi-k3.yaml for production, "
                        "recipes/local-dev.yaml for the sim and the CPU build); only with --recheck may it be left "
                        "out: the copy saved in DIR/evidence is used")
    parser.add_argument("--base-url", help="the server to check (http://HOST:PORT): /version, /v1/models, /metrics")
    parser.add_argument("--metrics-url", help="the engine's /metrics when it is not at --base-url (behind a "
                        "gateway); the key goes there only when it is on --base-url's host and port")
    parser.add_argument("--container-info", action=NodeFilesAction, default="", metavar="[NODE=]FILE",
                        help="saved `vllm collect-env` output from inside the serving container (the only accepted "
                        "source of the CUDA build); per node: NODE=FILE, repeated (NODE as its --host-inventory "
                        "names it; several also one a line or comma-separated); a bare FILE: a single node")
    parser.add_argument("--host-inventory", type=Path, action="append", default=[], metavar="FILE",
                        help="per-node inventory JSON, as `k3load inventory` writes it (repeat per node; format in "
                        "docs/running.md, example docs/examples/precheck/host-inventory.json)")
    parser.add_argument("--startup-log", action=NodeFilesAction, default="", metavar="[NODE=]FILE",
                        help="the vLLM server's startup log; per node: NODE=FILE, repeated (as --container-info); a "
                        "bare FILE: a single node")
    parser.add_argument("--image", help="container image actually deployed (repository:tag)")
    parser.add_argument("--custom-build", type=Path, help="YAML/JSON record of a custom build: commit, pytorch_deps, "
                        "build_time, reproduction, rollback_image")
    parser.add_argument("--no-nvml", action="store_true", help="do not inventory this host through NVML")
    parser.add_argument("--api-key", default=None, help="bearer key (prefer $K3_API_KEY: a flag shows in ps)")
    add_access_arguments(parser)
    parser.add_argument("--recheck", action="store_true", help="judge DIR/evidence again without gathering")
    parser.add_argument("--out", type=Path, required=True, help="run directory: writes evidence/ and compat.json")


def run(args: argparse.Namespace) -> int:
    """Gather (or recheck), print one line per rule, exit by status."""
    api_key = args.api_key or os.environ.get("K3_API_KEY") or None
    args.header = access_headers(args)  # --header, else $K3_HEADER
    try:
        _check_recipe_path(args.recipe)
        if problem := access_problem(api_key, args.header, args.ca_bundle, args.insecure, prefix="--"):
            raise PrecheckError(problem)
        if args.recheck:
            compat = recheck(args.out, args.recipe)
        elif args.recipe is None:
            raise PrecheckError("--recipe is required (unless --recheck)")
        else:
            if warning := plain_http_warning(args.base_url or "", bool(api_key or args.header)):
                print(warning, file=sys.stderr)
            compat = run_precheck(args.out, args.recipe, args.base_url, container_info=args.container_info,
                                  host_inventories=args.host_inventory, startup_log=args.startup_log,
                                  image=args.image, custom_build=args.custom_build,
                                  secrets=Secrets.parse(api_key, args.header), tls=Tls(args.ca_bundle, args.insecure),
                                  use_local_nvml=not args.no_nvml, metrics_url=args.metrics_url)
    except (RecipeError, PrecheckError, EvidenceFormatError) as exc:
        print(f"k3load precheck: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # an input that cannot be read, or DIR/evidence that cannot be written
        print(f"k3load precheck: {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    print("\n".join(summary_lines(compat, args.out / COMPAT)))
    return EXIT[compat["status"]]


def _check_recipe_path(recipe: Path | None) -> None:
    """A recipe path that is not there is named with its option (the loader would say only the path)."""
    if recipe is not None and not recipe.exists():
        raise PrecheckError(f"--recipe {recipe}: no such file")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m k3load.precheck.cli`) until `k3load precheck` is wired in."""
    parser = argparse.ArgumentParser(prog="k3load precheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
