#!/usr/bin/env bash
# Debian packages some tests need: Slurm + munge (a real two-node Slurm cluster on this machine,
# tests/launch/test_slurm.py), iproute2 (the emulated multi-node network), poppler-utils (the report's PDF
# rendered to PNG and text) and chromium (the report's HTML checked headless). Installs them when root and
# apt-get are there; otherwise says which tests will skip and the command that enables them. Never fails:
# the tests that need a missing package skip with the reason.
set -u
packages=(slurmd slurmctld slurm-client munge iproute2 poppler-utils chromium)
have_all() {
    for cmd in slurmctld slurmd sbatch munged ip tc pdftoppm chromium; do command -v "$cmd" > /dev/null || return 1; done
}
have_all && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "installing ${packages[*]} for the Slurm, emulated-network and report tests (apt-get)" >&2
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${packages[@]}") > /tmp/scalerl-test-packages.log 2>&1; then
        exit 0
    fi
    echo "warning: apt-get failed (log: /tmp/scalerl-test-packages.log); those tests will skip" >&2
    exit 0
fi
echo "note: the Slurm, emulated-network and report tests will skip; to run them: sudo apt-get install ${packages[*]}" >&2
exit 0
