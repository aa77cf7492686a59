#!/usr/bin/env bash
# Makes a base for compose/Dockerfile.* where Docker Hub's python image cannot be pulled: Debian bookworm with Python
# 3.11 (python3, venv, headers, CA certificates), debootstrapped from a Debian mirror and imported into Docker's image
# store. Then build with `--build-arg BASE=blink-base:bookworm`.
#
#   sudo compose/make_base.sh [TAG]      # TAG: blink-base:bookworm; needs debootstrap (apt install debootstrap)
#
# DEBIAN_MIRROR (http://deb.debian.org/debian) and DEBIAN_SECURITY_MIRROR pick the mirrors. The root filesystem is
# kept as a tarball under ${BLINK_CACHE_DIR:-~/.cache/blink}/compose/, so a later run imports it in seconds.
set -euo pipefail

tag=${1:-blink-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
cache=${BLINK_CACHE_DIR:-$HOME/.cache/blink}/compose
tarball=$cache/base-bookworm.tar

if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { echo "make_base: needs debootstrap (apt install debootstrap)" >&2; exit 1; }
    mkdir -p "$cache"
    rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs" "$tarball.part"' EXIT
    echo "make_base: debootstrapping Debian bookworm from $mirror (about a minute)" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
        bookworm "$rootfs" "$mirror" >&2
    cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
    # Package lists and downloaded packages: the image's own `apt-get update` fetches current ones.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
fi
docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tarball" "$tag" >/dev/null
echo "$tag"
