#!/usr/bin/env bash
# Build the documentation site offline, warnings as errors:  scripts/build_docs.sh [SITE_DIR]
# Needs the docs extra: pip install -e '.[docs]'. SITE_DIR is relative to the repository root;
# it defaults to ./site, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
exec mkdocs build --strict --site-dir "${1:-site}"
