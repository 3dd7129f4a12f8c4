#!/usr/bin/env bash
# Build the wheel and the sdist (python -m build), install each outside the checkout and
# check that the installed package imports and reports its version and licence (also
# through `fvstep --version`), and that the wheel passes a quick part of the test suite:
#   scripts/check_dist.sh
#   scripts/check_dist.sh --full    # the whole suite against the installed wheel (~10 min)
#
# Needs the `build` package (the dev extra). To keep CI short (.ci/run) it installs with
# --no-deps into a folder put first on PYTHONPATH, reusing the current environment's
# torch and test libraries; the full suite runs on the editable checkout. The tests run
# from a copy of tests/ in a folder outside the checkout, so that `import fvstep` can
# only find the installed copy (asserted below).
set -euo pipefail
full=0
[[ "${1:-}" == "--full" ]] && full=1
cd "$(dirname "$0")/.."
root="$PWD"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
    cat "$work/build.log"
    exit 1
}
# The wheel holds the library only: no benchmarks (applications, run from a checkout), no tests.
python - "$work"/dist/fvstep-*.whl <<'EOF'
import sys
import zipfile

tops = {name.split("/")[0] for name in zipfile.ZipFile(sys.argv[1]).namelist()}
stray = sorted(t for t in tops if t != "fvstep" and not t.endswith(".dist-info"))
assert not stray, f"the wheel holds more than the library: {stray}"
EOF
version="$(python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])' 2>/dev/null ||
    grep -m1 '^version' pyproject.toml | cut -d'"' -f2)"

for dist in "$work"/dist/fvstep-*.whl "$work"/dist/fvstep-*.tar.gz; do
    site="$work/site-$(basename "$dist")"
    python -m pip install -q --no-deps --target "$site" "$dist"
    cp -r "$root/tests" "$work/tests"
    (
        cd "$work"
        export PYTHONPATH="$site"
        python - "$site" "$version" <<'EOF'
import contextlib
import importlib.metadata as metadata
import io
import sys

import fvstep
from fvstep.cli import main

site, version = sys.argv[1], sys.argv[2]
assert fvstep.__file__.startswith(site), f"imported {fvstep.__file__}, not the installed copy"
assert metadata.version("fvstep") == version, metadata.version("fvstep")
assert metadata.metadata("fvstep")["License-Expression"] == "Apache-2.0"
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--version"])
assert out.getvalue() == f"fvstep {version}\n", out.getvalue()
EOF
        if [[ "$dist" == *.whl && $full == 1 ]]; then
            # The examples and docs the suite reads live beside tests/ in the checkout.
            # So do the benchmarks, which the tests import (benchmarks.reference) and run.
            cp -r "$root/examples" "$root/docs" "$root/README.md" "$root/benchmarks" "$work/"
            python -m pytest -q -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$work" tests
        elif [[ "$dist" == *.whl ]]; then
            python -m pytest -q -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$work" \
                tests/test_tree.py tests/test_state.py tests/test_schedules.py
        fi
    )
    rm -rf "$work/tests"
    echo "ok    $(basename "$dist"): installs, imports from the installed copy, version and licence"
done
