# Pinned versions of what the build fetches from PyPI; sourced by .ci/run
# and read by tools/prepare_device_deps.sh (keep the plain name=value form).
cutlass_version=4.2.0.0
