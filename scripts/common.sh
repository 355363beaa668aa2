# Shared by the scripts in this directory (sourced, not run).

VSA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VSA_ROOT

vsa_say() { printf '%s\n' "$*"; }
vsa_die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}
vsa_section() { printf '\n==== %s ====\n' "$*"; }

# vsa_usage_on_help "$@": with -h or --help as the first argument, prints the calling script's header comment (its
# usage) and exits; otherwise does nothing. Called by each script before it installs or builds anything.
vsa_usage_on_help() {
  case "${1:-}" in
  -h | --help) ;;
  *) return 0 ;;
  esac
  local line
  while IFS= read -r line; do
    case "$line" in
    '#!'*) continue ;;
    '# shellcheck'*) break ;;
    '#'*) line="${line#\#}"; printf '%s\n' "${line# }" ;;
    *) break ;;
    esac
  done <"${BASH_SOURCE[1]}"
  exit 0
}

# vsa_quietly <command...>: runs the command with its output kept in a log, printed only when it fails; with
# VSA_VERBOSE=1 the output goes through as it comes. For the tools whose chatter says nothing on success (apt-get).
vsa_quietly() {
  if [ "${VSA_VERBOSE:-0}" = 1 ]; then
    "$@"
    return
  fi
  local log rc=0
  log="$(mktemp)"
  "$@" >"$log" 2>&1 || rc=$?
  [ $rc -eq 0 ] || cat "$log" >&2
  rm -f "$log"
  return $rc
}

# Installs the Debian packages among "$@" that are missing, when running as root with apt-get; otherwise (or when
# apt-get fails) says which are missing and goes on, so that the build reports what it actually lacks.
vsa_install_packages() {
  command -v dpkg-query >/dev/null 2>&1 || return 0
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    vsa_say "installing missing packages: ${missing[*]}"
    # A machine without a package mirror goes on with what it has; the configure step names what is lacking.
    if ! vsa_quietly env DEBIAN_FRONTEND=noninteractive apt-get update -q ||
      ! vsa_quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; then
      vsa_say "warning: apt-get could not install ${missing[*]}; going on without them" >&2
    fi
  else
    vsa_say "note: missing packages (not installed: needs root and apt-get): ${missing[*]}" >&2
  fi
}

# The packages every build needs (the compiler, CMake, Ninja, the test and benchmark frameworks), and those of
# the AMD build; used by the scripts that source this file.
# shellcheck disable=SC2034
{
  VSA_BASE_PACKAGES=(cmake ninja-build g++ catch2 libbenchmark-dev)
  VSA_AMD_PACKAGES=(hipcc librocprim-dev libamdhip64-dev)
}

# Puts nvcc on PATH if the CUDA toolkit is installed in its usual place; returns 1 when there is none.
vsa_find_nvcc() {
  if ! command -v nvcc >/dev/null 2>&1; then
    local dir
    for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
      if [ -n "$dir" ] && [ -x "$dir/bin/nvcc" ]; then
        export PATH="$dir/bin:$PATH"
        break
      fi
    done
  fi
  command -v nvcc >/dev/null 2>&1
}

# True when an NVIDIA GPU can run the tests: the driver lists a device and nvcc is there to build for it.
vsa_have_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && vsa_find_nvcc
}

# hipcc picks its platform from the tools it finds (CUDA before ROCm on some installs) and asks the machine's
# GPUs for a target when given none; an AMD build fixes both.
vsa_amd_environment() {
  export HIP_PLATFORM=amd
  export HCC_AMDGPU_TARGET="${HCC_AMDGPU_TARGET:-gfx90a}"
}

vsa_jobs() { nproc 2>/dev/null || echo 2; }

# vsa_configure <build-dir> <cmake args...>: Ninja when available, Release. VSA_WARNINGS_AS_ERRORS (ON|OFF),
# VSA_NVIDIA_ARCHS and VSA_AMD_TARGETS in the environment are passed on; left unset, a build directory keeps what
# it was configured with (defaults: OFF, 80;90a, gfx90a;gfx940).
vsa_configure() {
  local dir="$1"
  shift
  command -v cmake >/dev/null 2>&1 || vsa_die "cmake not found (Debian: apt-get install cmake)"
  local extra=()
  # An existing build directory keeps the generator it was made with.
  if [ ! -f "$dir/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then extra+=(-G Ninja); fi
  local var
  for var in VSA_WARNINGS_AS_ERRORS VSA_NVIDIA_ARCHS VSA_AMD_TARGETS; do
    if [ -n "${!var:-}" ]; then extra+=("-D$var=${!var}"); fi
  done
  cmake -S "$VSA_ROOT" -B "$dir" "${extra[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
}

vsa_build() {
  local dir="$1"
  shift
  # Ninja's progress line with the time since the build began: which file of how many, and how long so far
  # (a single GPU translation unit compiles for up to 90 s with nothing else printed).
  NINJA_STATUS="${NINJA_STATUS:-[%f/%t, %es] }" cmake --build "$dir" --parallel "$(vsa_jobs)" "$@"
}

# Resolves a build directory argument against the caller's working directory.
vsa_abs_dir() {
  case "$1" in
  /*) printf '%s\n' "$1" ;;
  *) printf '%s\n' "$PWD/$1" ;;
  esac
}

# vsa_wgmma_serialized <build log>: lists the kernels whose wgmma ptxas serialized, as the log of an NVIDIA build
# reports them (scripts/compile-gpu, bench/run-gpu), or says that the log reports none.
vsa_wgmma_serialized() {
  local found
  found="$(grep -a "wgmma.mma_async instructions are serialized" "$1" | grep -o "(C75[0-9]*).*function '[^']*'" |
    sed "s/^(\(C75[0-9]*\)).*function '\(.*\)'\$/\2 \1/" | sort -u | { c++filt 2>/dev/null || cat; } |
    sed 's/vsa::gpu::detail:://g; s/vsa::gpu:://g')" || true
  if [ -n "$found" ]; then
    vsa_say "warning: ptxas serialized the wgmma of $(printf '%s\n' "$found" | wc -l) kernel(s):"
    printf '%s\n' "$found" | sed 's/^/  /'
  else
    vsa_say "no serialized wgmma reported in what this build compiled"
  fi
}
