#!/usr/bin/env bash
# Builds the image helm/specdist runs (the repository's Dockerfile, unchanged) without a Docker engine and without
# the official Ray image: buildah builds it (vfs storage, chroot isolation: no daemon, no runtime, runs as root in
# an unprivileged container too) on a stand-in for rayproject/ray made from Debian's packages by mmdebstrap.
#
#   helm/image/build.sh [TAG]          # default TAG specdist:0.1.0-cpu; prints the build time and the image size
#
# The stand-in base is what the Dockerfile expects of a Ray image: Debian bookworm (Python 3.11, apt), a user `ray`
# (uid 1000, group `users`), a Python environment at /home/ray/anaconda3 first on PATH, holding the CPU build of
# torch (the Dockerfile's `pip install torch==2.13.0` then finds it installed instead of pulling PyPI's CUDA build).
# pip inside the build trusts the CA bundle pip trusts here (copied in, PIP_CERT): a public bundle, not a secret.
# The base is cached in buildah's storage under a tag keyed on its inputs (suite, packages, torch wheel, CA bundle,
# this script); a rebuild reuses it. Settings (environment):
#   TORCH_WHEEL    a CPU torch wheel for cp311 (default: `pip download torch==$TORCH_VERSION+cpu` for Python 3.11;
#                  where pip does not find it, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   TORCH_VERSION  2.13.0 (the README's pin)
#   DEBIAN_MIRROR  mmdebstrap's mirror (default: its own, deb.debian.org)
#   BUILDAH        the buildah command (default: buildah --storage-driver vfs)
set -euo pipefail
cd "$(dirname "$0")/../.."

missing=$(for t in buildah mmdebstrap; do command -v "$t" >/dev/null || printf '%s ' "$t"; done)
if [ -n "$missing" ]; then
  echo "build.sh: missing ${missing% } (Debian: apt-get install -y buildah mmdebstrap; then run as root)" >&2
  exit 2
fi

tag=${1:-specdist:0.1.0-cpu}
torch_version=${TORCH_VERSION:-2.13.0}
read -r -a bah <<< "${BUILDAH:-buildah --storage-driver vfs}"
suite=bookworm
packages=python3,python3-venv,python3-pip,ca-certificates
work=${XDG_CACHE_HOME:-$HOME/.cache}/specdist-image  # the torch wheel and the base's root filesystem tarball
mkdir -p "$work"
t0=$SECONDS

if [ -z "${TORCH_WHEEL:-}" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work/torch" "torch==$torch_version+cpu"
  TORCH_WHEEL=$(ls "$work"/torch/torch-"$torch_version"+cpu-cp311-*.whl | head -n1)
fi
ca=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
ca=${ca:-/etc/ssl/certs/ca-certificates.crt}

key=$( { echo "$suite $packages ${DEBIAN_MIRROR:-}"; sha256sum "$TORCH_WHEEL" "$ca" | cut -d' ' -f1
         sed -n '/^# --- base/,/^# --- end base/p' "$0"; } | sha256sum | cut -c1-12)
base=localhost/specdist-ray-base:$key

# --- base: the stand-in for rayproject/ray:2.60.0-py311-cpu (its key covers these lines)
if "${bah[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  echo "base: $base (cached)"
else
  echo "base: building $base"
  tarball=$work/$suite-$key.tar
  # shellcheck disable=SC2086  # the mirror is one optional word
  mmdebstrap --quiet --variant=apt --include="$packages" "$suite" "$tarball" ${DEBIAN_MIRROR:-}
  c=$("${bah[@]}" from scratch)
  trap '"${bah[@]}" rm "$c" >/dev/null 2>&1 || true' EXIT
  "${bah[@]}" add --quiet "$c" "$tarball" /
  "${bah[@]}" copy --quiet "$c" "$ca" /etc/ssl/certs/pip-build-ca.pem
  "${bah[@]}" copy --quiet "$c" "$TORCH_WHEEL" "/tmp/$(basename "$TORCH_WHEEL")"
  "${bah[@]}" run --isolation chroot "$c" -- sh -ec "
    useradd --create-home --uid 1000 --gid users --shell /bin/bash ray
    su ray -c 'python3 -m venv /home/ray/anaconda3'
    su ray -c 'PIP_CERT=/etc/ssl/certs/pip-build-ca.pem /home/ray/anaconda3/bin/pip install --no-cache-dir -q \
      /tmp/$(basename "$TORCH_WHEEL")'
    rm /tmp/*.whl
    apt-get clean && rm -rf /var/lib/apt/lists/*"
  "${bah[@]}" config --user ray --workingdir /home/ray \
    --env PATH=/home/ray/anaconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env HOME=/home/ray --env PIP_CERT=/etc/ssl/certs/pip-build-ca.pem --cmd /bin/bash "$c"
  "${bah[@]}" commit --quiet --rm "$c" "$base" >/dev/null
  trap - EXIT
  rm -f "$tarball"
fi
# --- end base

# The build context: the files git tracks and new files it does not ignore, as they are in this checkout. Files git
# ignores (build outputs, caches, local scratch, keys) never reach the image, whatever .dockerignore says.
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | tar -xf - -C "$context"
else
  cp -a . "$context"
fi
t1=$SECONDS
"${bah[@]}" bud --isolation chroot --pull=never --build-arg RAY_IMAGE="$base" -t "$tag" -f Dockerfile "$context"
t2=$SECONDS
size=$("${bah[@]}" images --noheading --format '{{.Size}}' "$tag")
echo "image $tag: $size; build $((t2 - t1)) s from the base (base and wheel $((t1 - t0)) s)"
