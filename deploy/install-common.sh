# shellcheck shell=bash
# What deploy/install-agent.sh and deploy/install-server.sh share (sourced by them, never run): options,
# checks, the service user, the venv, config and keys in /etc/skyfed, the systemd unit, and --uninstall.
# The role scripts set ROLE, CONFIG_NAME, UNIT, OTHER_UNIT, EXTRA_GROUPS and the role_* hooks, then call
# install_main "$@".
#
# What an install leaves on the host (every path under --root DIR when given):
#   /opt/skyfed/venv       the venv, at the path the unit's ExecStart names; root-owned. Its .skyfed-install
#                          records the source, options and pins it was built from: pip runs only when they change
#   /opt/skyfed/README.md  the unit's Documentation=
#   /etc/skyfed/           the provisioning folder: directories 0750 and files 0640 root:skyfed, private keys
#                          (*.key, and whatever keys.identity or broker.tls.keyfile names) 0600 skyfed:skyfed
#   /var/lib/skyfed/       the user skyfed's home and the daemons' state: 0700 skyfed:skyfed
#   /etc/systemd/system/skyfed-<role>.service
#
# Idempotent: files are compared before they are copied, owners and modes are set only where they differ,
# pip runs only when the stamp differs, and the service is restarted only when something it uses changed.
# Config and keys that differ from the provisioning folder are kept (and named) unless --force-config.
# Every check on the input runs before anything is changed; the daemon's own config loader, which needs
# the venv, runs after the venv is built and before the config is installed.

set -euo pipefail
umask 022
: "${ROLE:?}" "${CONFIG_NAME:?}" "${UNIT:?}" "${OTHER_UNIT:?}" # set by the role script that sources this

DEPLOY_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CHECKOUT=$(dirname "$DEPLOY_DIR")
PROG=$(basename "$0")
ETC=/etc/skyfed
STATE=/var/lib/skyfed
USER_NAME=skyfed
CPU_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu

# options (set by parse_options)
ROOT=""
PROV=""
SOURCE=""
PYTHON=python3
TORCH=auto
TORCH_INDEX=default
CONSTRAINTS=""
DETECT=0
NO_DEPS=0
NO_START=0
FORCE_CONFIG=0
UNINSTALL=0
PURGE=0

# state of this run
STAGE=""
SERVICE_CHANGED=0
DATA_MISSING=""
PRIVATE_REFS=()
ENROLLED="" # keys.enrolled of the config (server; agent in peer mode): revoked keys leave it

say() { printf '%s\n' "$*"; }
note() { printf 'note: %s\n' "$*" >&2; }
die() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit 1
}
usage_error() {
    printf '%s: %s (see --help)\n' "$PROG" "$*" >&2
    exit 2
}
at() { printf '%s%s' "$ROOT" "$1"; } # a path of the target system, as seen from here

common_usage() {
    cat <<EOF
options:
  --torch auto|cpu|cuda|system  which PyTorch the venv gets (default auto: system on a Jetson, cpu on
                        other aarch64 boards, cuda on x86_64):
                          cpu     PyTorch's CPU build of the pinned release, from --torch-index
                                  (x86_64: the +cpu wheel; PyPI's x86_64 torch is a CUDA build)
                          cuda    the pinned release from PyPI as constraints.txt says (CUDA on x86_64)
                          system  a venv with --system-site-packages that uses the PyTorch already
                                  installed for --python (JetPack's wheel); pip never installs torch
  --torch-index URL|none  where --torch cpu finds CPU wheels, besides pip's own indexes (default
                        $CPU_INDEX_DEFAULT; none: pip's configured indexes only)
  --detect              also install YOLO detection (Ultralytics, the [detect] extra)
  --constraints FILE    the pins (default: constraints.txt of the source; with --torch system on
                        Python 3.10, i.e. JetPack 6: deploy/constraints-jetson.txt)
  --source DIR|WHEEL    the SkyFed to install (default: the checkout this script is in, $CHECKOUT)
  --python PATH         the interpreter the venv is built from (default python3)
  --root DIR            install into DIR as if it were /: users via useradd --prefix, the unit enabled
                        with systemctl --root, nothing started (for tests and images; the venv works
                        where it lies, not after a chroot)
  --no-start            install, but do not enable or (re)start the service (or restart mosquitto)
  --force-config        replace config and keys in $ETC that differ from the provisioning folder
                        (without it they are kept, and named)
  --no-deps             install SkyFed alone into a venv that sees --python's site-packages (a venv's
                        own too): for tests, and for hosts where every dependency is installed already
  --uninstall           stop and remove the service, its unit and the venv; keeps $ETC,
                        $STATE and the user $USER_NAME
  --purge               with --uninstall: remove those too
  -h, --help            this text
EOF
}

parse_options() {
    while (($#)); do
        case $1 in
        --torch) TORCH=${2:?--torch needs a value} && shift ;;
        --torch-index) TORCH_INDEX=${2:?--torch-index needs a value} && shift ;;
        --constraints) CONSTRAINTS=${2:?--constraints needs a file} && shift ;;
        --source) SOURCE=${2:?--source needs a folder or wheel} && shift ;;
        --python) PYTHON=${2:?--python needs a path} && shift ;;
        --root) ROOT=${2:?--root needs a folder} && shift ;;
        --detect) DETECT=1 ;;
        --no-deps) NO_DEPS=1 ;;
        --no-start) NO_START=1 ;;
        --force-config) FORCE_CONFIG=1 ;;
        --uninstall) UNINSTALL=1 ;;
        --purge) PURGE=1 ;;
        -h | --help)
            role_usage
            common_usage
            exit 0
            ;;
        --*)
            ROLE_SHIFT=0
            role_option "$@" # sets its variable and ROLE_SHIFT, the arguments it took (0: not its option)
            ((ROLE_SHIFT > 0)) || usage_error "unknown option $1"
            shift $((ROLE_SHIFT - 1))
            ;;
        *)
            [[ -z $PROV ]] || usage_error "one provisioning folder only (got $PROV and $1)"
            PROV=$1
            ;;
        esac
        shift
    done
    case $TORCH in auto | cpu | cuda | system) ;; *) usage_error "--torch must be auto, cpu, cuda or system, not '$TORCH'" ;; esac
    ((PURGE == 0 || UNINSTALL == 1)) || usage_error "--purge goes with --uninstall"
    if ((UNINSTALL == 0)); then
        [[ -n $PROV ]] || usage_error "which provisioning folder? (e.g. fleet-pki/$(role_example))"
    fi
}

# --- checks (nothing is changed until they all pass) -------------------------------------------------
check_root_and_target() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it creates the user $USER_NAME and hands files to it), e.g. sudo $0 ..."
    if [[ -n $ROOT ]]; then
        [[ -d $ROOT ]] || die "--root $ROOT: no such folder"
        ROOT=$(realpath "$ROOT")
        [[ $ROOT != / ]] || ROOT=""
    fi
    if [[ -n $ROOT ]]; then
        [[ -f $ROOT/etc/passwd && -f $ROOT/etc/group ]] ||
            die "--root $ROOT has no etc/passwd and etc/group: it must look like a system root"
    fi
}

# The venv the unit runs: ExecStart=<venv>/bin/skyfed ... (the unit file is the one source of this path).
venv_of_unit() {
    local unit=$1 exec
    exec=$(sed -n 's/^ExecStart=[-@:+!]*\([^ ]*\).*/\1/p' "$unit" | head -n1)
    [[ $exec == /*/bin/skyfed ]] || die "$unit: ExecStart runs '$exec', not <venv>/bin/skyfed"
    dirname "$(dirname "$exec")"
}

# Field FIELD of NAME's entry in the passwd or group database (the scratch root's under --root).
db_field() {
    local db=$1 name=$2 field=$3
    if [[ -n $ROOT ]]; then
        awk -F: -v n="$name" -v f="$field" '$1 == n { print $f; exit }' "$ROOT/etc/$db"
    else
        getent "$db" "$name" | cut -d: -f"$field" || true
    fi
}

uid_of() { db_field passwd "$1" 3; }
gid_of() { db_field group "$1" 3; }
primary_gid_of() { db_field passwd "$1" 4; }
group_members() { db_field group "$1" 4; }

# The value of KEY in [TABLE] of a TOML file: the few keys the checks need, written as the configs are
# (key = "string", key = 'string' or a bare value). The daemon's own loader checks the whole file later.
toml_get() {
    awk -v want_table="$2" -v want_key="$3" '
        function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s); return s }
        /^[ \t]*\[/ { t = $0; sub(/^[ \t]*\[[ \t]*/, "", t); sub(/[ \t]*\].*$/, "", t); table = t; next }
        table == want_table {
            eq = index($0, "=")
            if (eq == 0) next
            key = trim(substr($0, 1, eq - 1)); gsub(/"/, "", key)
            if (key != want_key) next
            v = trim(substr($0, eq + 1))
            if (v ~ /^"/) { v = substr(v, 2); sub(/".*$/, "", v) }
            else if (v ~ /^\047/) { v = substr(v, 2); sub(/\047.*$/, "", v) }
            else { sub(/[ \t]*#.*$/, "", v) }
            print v; exit
        }' "$1"
}

# Where a path named in the config comes from: relative paths and paths under /etc/skyfed are files of
# the provisioning folder (printed relative to it); any other absolute path must exist on the target.
# Prints "prov REL" or "host PATH"; fails when it is missing.
resolve_ref() {
    local key=$1 value=$2 what=$3 kind=${4:-f} rel
    if [[ $value == /* && $value != "$ETC"/* ]]; then
        [[ -e $(at "$value") ]] || die "$CONFIG_NAME: $key = '$value': $what not found at $(at "$value")"
        printf 'host %s\n' "$value"
        return
    fi
    rel=${value#"$ETC"/}
    rel=${rel#./}
    if [[ $kind == d ]]; then
        [[ -d $PROV/$rel ]] || die "$PROV/$CONFIG_NAME: $key = '$value': $what not found at $PROV/$rel"
    else
        [[ -f $PROV/$rel ]] || die "$PROV/$CONFIG_NAME: $key = '$value': $what not found at $PROV/$rel"
    fi
    printf 'prov %s\n' "$rel"
}

# A key file the config names: checked, and remembered as private when it is one.
check_key_ref() {
    local table=$1 key=$2 what=$3 private=$4 value ref
    value=$(toml_get "$PROV/$CONFIG_NAME" "$table" "$key")
    [[ -n $value ]] || die "$PROV/$CONFIG_NAME: [$table] $key is missing ($what); see deploy/examples/$CONFIG_NAME"
    ref=$(resolve_ref "$table.$key" "$value" "$what" "${5:-f}")
    if [[ $private == private && $ref == prov\ * ]]; then
        PRIVATE_REFS+=("${ref#prov }")
    fi
}

check_tls_refs() {
    local key value
    for key in ca_certs certfile keyfile; do
        value=$(toml_get "$PROV/$CONFIG_NAME" broker.tls "$key")
        [[ -n $value ]] || continue
        if [[ $key == keyfile ]]; then
            check_key_ref broker.tls keyfile "TLS client key" private
        else
            check_key_ref broker.tls "$key" "TLS file" public
        fi
    done
}

# state_dir must lie under /var/lib/skyfed: the unit keeps everything else read-only (ProtectSystem=strict).
check_state_dir() {
    local table=$1 value
    value=$(toml_get "$PROV/$CONFIG_NAME" "$table" state_dir)
    [[ -n $value ]] || die "$PROV/$CONFIG_NAME: [$table] state_dir is missing"
    if [[ $value != "$STATE" && $value != "$STATE"/* ]]; then
        die "$PROV/$CONFIG_NAME: $table.state_dir = '$value' is outside $STATE: the service may write only there" \
            "(systemd StateDirectory=skyfed); set it under $STATE, as skyfed provision does ($STATE/<node>)"
    fi
    STATE_DIRS+=("$value")
}

# A data file the daemon reads (agent.data, server.eval_data): its absence does not stop the install,
# but the service is not started without it (the daemon would refuse its config).
check_data_ref() {
    local table=$1 key=$2 value where
    value=$(toml_get "$PROV/$CONFIG_NAME" "$table" "$key")
    [[ -n $value ]] || return 0
    if [[ $value == /* ]]; then
        where=$value
    else
        [[ ! -e $PROV/${value#./} ]] || return 0 # installed with the folder
        where=$ETC/${value#./}
    fi
    [[ ! -e $(at "$where") ]] || return 0
    [[ $where != "$STATE"/* ]] || STATE_DIRS+=("$(dirname "$where")")
    DATA_MISSING=$where
    note "$table.$key: no data at $where yet${ROOT:+ (in $ROOT)}: put it there (owned by $USER_NAME), then: systemctl start $UNIT"
}

check_python() {
    local resolved
    resolved=$(command -v "$PYTHON") || die "--python $PYTHON: not found"
    PYTHON=$resolved
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        die "--python $PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'): SkyFed needs 3.10 or newer"
    "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null ||
        die "--python $PYTHON cannot make a venv (no ensurepip): apt-get install python3-venv (python3.10-venv on Ubuntu 22.04)"
    PY_VERSION=$("$PYTHON" -c 'import platform; print(platform.python_version())')
}

is_jetson() { [[ -e $(at /etc/nv_tegra_release) ]]; } # L4T's release file: JetPack on a Jetson

check_torch() {
    ARCH=$(uname -m)
    if [[ $TORCH == auto ]]; then
        if is_jetson; then
            TORCH=system
        elif [[ $ARCH == aarch64 ]]; then
            TORCH=cpu
        else
            TORCH=cuda
        fi
        local on=$ARCH
        ! is_jetson || on="$ARCH, a Jetson"
        say "torch: --torch $TORCH (auto on $on); pass --torch to choose"
    fi
    if [[ $TORCH == cuda ]] && is_jetson; then
        die "--torch cuda: PyPI's torch has no CUDA for Jetson; install NVIDIA's PyTorch wheel for your JetPack" \
            "and use --torch system (docs/deploy.md: Install on a device)"
    fi
    if [[ $TORCH_INDEX == default ]]; then
        if [[ $TORCH == cpu ]]; then TORCH_INDEX=$CPU_INDEX_DEFAULT; else TORCH_INDEX=none; fi
    fi
    if ((NO_DEPS == 1)); then # the dependencies come from --python's site-packages, as they are: all of them
        local needed="cryptography, numpy, paho.mqtt.client, safetensors, torch"
        ((DETECT == 0)) || needed+=", torchvision" # the detect extra's, which pip check (check_deps) does not see
        (cd / && "$PYTHON" -I -c "import $needed" 2>/dev/null) ||
            die "--no-deps: $PYTHON cannot import SkyFed's dependencies ($needed): install them for it first," \
                "or leave out --no-deps"
        return 0
    fi
    if [[ $TORCH == system ]]; then
        "$PYTHON" -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)' ||
            die "--torch system: --python $PYTHON belongs to a virtual environment; name the interpreter PyTorch" \
                "is installed for (e.g. /usr/bin/python3)"
        local modules=torch
        ((DETECT == 0)) || modules="torch, torchvision"
        "$PYTHON" -c "import $modules" 2>/dev/null ||
            die "--torch system: $PYTHON cannot import $modules: install NVIDIA's wheel(s) for your JetPack" \
                "system-wide first (sudo pip3 install ..., not --user: the service user must see it)"
        say "torch: $("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA" if torch.cuda.is_available() else "CPU only")')" \
            "from $PYTHON"
    fi
}

check_source() {
    [[ -n $SOURCE ]] || SOURCE=$CHECKOUT
    [[ -e $SOURCE ]] || die "--source $SOURCE: no such file or folder"
    SOURCE=$(realpath "$SOURCE")
    if [[ -d $SOURCE ]]; then
        [[ -f $SOURCE/setup.cfg && -f $SOURCE/skyfed/__init__.py ]] || die "--source $SOURCE is not a SkyFed checkout (no setup.cfg, skyfed/)"
    else
        [[ $SOURCE == *.whl && $(basename "$SOURCE") == skyfed-* ]] || die "--source $SOURCE: a SkyFed checkout or skyfed-*.whl"
    fi
    if [[ -z $CONSTRAINTS ]]; then
        if [[ $TORCH == system ]] && "$PYTHON" -c 'import sys; sys.exit(sys.version_info >= (3, 11))'; then
            CONSTRAINTS=$DEPLOY_DIR/constraints-jetson.txt # JetPack 6: Python 3.10 and NVIDIA's torch
        elif [[ -d $SOURCE ]]; then
            CONSTRAINTS=$SOURCE/constraints.txt
        else
            CONSTRAINTS=$CHECKOUT/constraints.txt
        fi
    fi
    [[ -f $CONSTRAINTS ]] || die "--constraints $CONSTRAINTS: no such file"
    CONSTRAINTS=$(realpath "$CONSTRAINTS")
    if [[ $TORCH != system ]] && ((NO_DEPS == 0)) && ! grep -Eq '^[[:space:]]*torch[[:space:]]*==' "$CONSTRAINTS"; then
        die "--constraints $CONSTRAINTS pins no torch: with --torch $TORCH pip would pick any release (a CUDA" \
            "build of several GB); add torch== and torchvision== lines, or use --torch system"
    fi
}

check_provisioning_folder() {
    [[ -d $PROV ]] || die "provisioning folder $PROV: no such folder (skyfed provision writes fleet-pki/$(role_example))"
    PROV=$(realpath "$PROV")
    [[ -f $PROV/$CONFIG_NAME ]] || die "$PROV has no $CONFIG_NAME: is it the folder for this node (fleet-pki/$(role_example))?"
    STATE_DIRS=()
    role_check_config
    check_tls_refs
}

# --- the service user and its directories ------------------------------------------------------------
# Owner and mode of PATH, set only where they differ (numeric ids: --root has its own passwd).
fix() {
    local path=$1 mode=$2 owner=$3
    [[ $(stat -c %a "$path") == "${mode#0}" ]] || chmod "$mode" "$path"
    [[ $(stat -c %u:%g "$path") == "$owner" ]] || chown "$owner" "$path"
}

ensure_dir() {
    local path=$1 mode=$2 owner=$3
    if [[ ! -d $path ]]; then
        mkdir -p "$path"
        say "  created $path"
    fi
    fix "$path" "$mode" "$owner"
}

# Copy SRC to DEST (atomically) unless it is there already with the same content; with POLICY keep, a
# different DEST stays unless --force-config. Returns 0 when DEST was written.
put_file() {
    local src=$1 dest=$2 mode=$3 owner=$4 policy=${5:-replace} tmp
    if [[ -f $dest ]]; then
        if cmp -s "$src" "$dest"; then
            fix "$dest" "$mode" "$owner"
            return 1
        fi
        if [[ $policy == keep ]] && ((FORCE_CONFIG == 0)); then
            note "kept $dest: it differs from $src (--force-config replaces it)"
            fix "$dest" "$mode" "$owner"
            return 1
        fi
    fi
    tmp=$(mktemp "$(dirname "$dest")/.skyfed-install.XXXXXX")
    cat "$src" >"$tmp"
    chmod "$mode" "$tmp"
    chown "$owner" "$tmp"
    mv -f "$tmp" "$dest"
    say "  installed $dest"
    return 0
}

ensure_link() {
    local target=$1 link=$2
    [[ -L $link && $(readlink "$link") == "$target" ]] && return 1
    ln -sfn "$target" "$link"
    say "  linked $link -> $target"
    return 0
}

prefix_args() { [[ -z $ROOT ]] || printf '%s\n' --prefix "$ROOT"; }

ensure_user() {
    local -a prefix
    mapfile -t prefix < <(prefix_args)
    if [[ -z $(uid_of "$USER_NAME") ]]; then
        useradd "${prefix[@]}" --system --user-group --home-dir "$STATE" --no-create-home \
            --shell /usr/sbin/nologin --comment SkyFed "$USER_NAME"
        say "  created system user $USER_NAME (home $STATE, no login shell)"
        SERVICE_CHANGED=1
    fi
    local group members
    for group in "${EXTRA_GROUPS[@]}"; do
        members=$(group_members "$group")
        if [[ ",$members," != *",$USER_NAME,"* ]]; then
            usermod "${prefix[@]}" --append --groups "$group" "$USER_NAME"
            say "  added $USER_NAME to group $group"
            SERVICE_CHANGED=1
        fi
    done
    SKYFED_UID=$(uid_of "$USER_NAME")
    SKYFED_GID=$(gid_of "$USER_NAME")
    [[ -n $SKYFED_UID && -n $SKYFED_GID ]] || die "user $USER_NAME or its group is missing after useradd"
}

check_extra_groups() {
    local group
    for group in "${EXTRA_GROUPS[@]}"; do
        [[ -n $(gid_of "$group") ]] ||
            die "group $group does not exist on $(at /) (the unit's SupplementaryGroups needs it): groupadd --system $group"
    done
}

ensure_state_dirs() {
    ensure_dir "$(at "$STATE")" 0700 "$SKYFED_UID:$SKYFED_GID"
    local dir
    for dir in "${STATE_DIRS[@]}"; do
        ensure_dir "$(at "$dir")" 0700 "$SKYFED_UID:$SKYFED_GID"
    done
}

# --- the venv -----------------------------------------------------------------------------------------
cleanup() { [[ -z $STAGE ]] || rm -rf "$STAGE"; }

# The source as pip will build it, and its fingerprint. A checkout contributes its build files and its
# Python packages (top-level folders with an __init__.py, less tests and benchmarks), so neither the
# checkout (no build/ or egg-info written into it) nor the fingerprint sees anything else in it.
stage_source() {
    STAGE=$(mktemp -d)
    trap cleanup EXIT
    if [[ -f $SOURCE ]]; then
        WHEEL=$SOURCE
        SOURCE_HASH=$(sha256sum "$SOURCE" | cut -d' ' -f1)
        return
    fi
    local -a parts=()
    local name
    for name in setup.cfg setup.py pyproject.toml MANIFEST.in README.md; do
        [[ ! -f $SOURCE/$name ]] || parts+=("$name")
    done
    for name in "$SOURCE"/*/__init__.py; do
        name=$(basename "$(dirname "$name")")
        [[ $name == tests || $name == benchmarks ]] || parts+=("$name")
    done
    mkdir "$STAGE/src"
    tar -C "$SOURCE" --exclude=__pycache__ --exclude='*.pyc' -cf - "${parts[@]}" | tar -C "$STAGE/src" -xf -
    SOURCE_HASH=$(cd "$STAGE/src" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
    WHEEL=""
}

# The pins pip gets for this --torch: cpu pins the +cpu build on x86_64 (on aarch64 the plain pin also
# matches the CPU index's wheels), system drops torch and torchvision (the device's own stay; pip must
# never replace them).
stage_constraints() {
    local out=$STAGE/constraints.txt
    case $TORCH in
    cuda) cp "$CONSTRAINTS" "$out" ;;
    system) grep -Ev '^[[:space:]]*(torch|torchvision)[[:space:]]*(==|$|[<>=!~;])' "$CONSTRAINTS" >"$out" || true ;;
    cpu)
        if [[ $ARCH == x86_64 ]]; then
            sed -E 's/^[[:space:]]*(torch|torchvision)[[:space:]]*==[[:space:]]*([^+[:space:];#]+)[[:space:]]*$/\1==\2+cpu/' \
                "$CONSTRAINTS" >"$out"
        else
            cp "$CONSTRAINTS" "$out"
        fi
        ;;
    esac
    STAGED_CONSTRAINTS=$out
}

extras() {
    ((DETECT == 0)) || printf '[detect]'
}

venv_stamp() {
    printf 'source=%s\n' "$SOURCE_HASH"
    printf 'python=%s\n' "$PY_VERSION"
    printf 'torch=%s\n' "$TORCH"
    printf 'torch_index=%s\n' "$TORCH_INDEX"
    printf 'extras=%s\n' "$(extras)"
    printf 'no_deps=%s\n' "$NO_DEPS"
    ((NO_DEPS == 0)) || printf 'deps_from=%s\n' "$(python_own_site)"
    printf 'constraints=%s\n' "$(sha256sum "$STAGED_CONSTRAINTS" | cut -d' ' -f1)"
}

pip_quiet() {
    # the grep drops pip-config noise about local wheel folders that are absent on some machines
    "$VENV_DIR/bin/python" -m pip --disable-pip-version-check --no-input "$@" 2>&1 |
        { grep -v "^WARNING: Location 'file:" || true; }
}

# A venv's --python: its own site-packages, which a venv made from it with --system-site-packages does not see (that
# is its base interpreter's); empty for a system interpreter
python_own_site() {
    "$PYTHON" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))'
}

# --no-deps: SkyFed's venv sees --python's packages, a venv's own site-packages named in a .pth; without it, no
# such .pth stays from an earlier --no-deps install (pip would take what it names as installed)
link_deps() {
    local site own=""
    site=$("$VENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    ((NO_DEPS == 0)) || own=$(python_own_site)
    if [[ -n $own ]]; then printf '%s\n' "$own" >"$site/skyfed-deps.pth"; else rm -f "$site/skyfed-deps.pth"; fi
}

# --no-deps: every requirement of the installed SkyFed is met where its service will look (-I: no PYTHONPATH, no
# user site), as pip check finds them; checked before the install for the main ones (check_torch)
check_deps() {
    local missing
    missing=$(cd / && "$VENV_DIR/bin/python" -I -m pip check --disable-pip-version-check 2>&1 | grep '^skyfed ') || true
    [[ -z $missing ]] || die "--no-deps, with $PYTHON's packages: $missing Install SkyFed's dependencies for it" \
        "first, or leave out --no-deps"
}

venv_matches_python() {
    [[ -x $VENV_DIR/bin/python ]] &&
        "$VENV_DIR/bin/python" -c "import platform, sys; sys.exit(platform.python_version() != '$PY_VERSION')"
}

ensure_venv() {
    local system_site="" wanted_site=false stamp wheels
    VENV_DIR=$(at "$VENV")
    if [[ $TORCH == system ]] || ((NO_DEPS == 1)); then wanted_site=true; fi
    stage_source
    stage_constraints
    stamp=$(venv_stamp)
    if [[ -f $VENV_DIR/pyvenv.cfg ]]; then
        system_site=$(sed -n 's/^include-system-site-packages = //p' "$VENV_DIR/pyvenv.cfg")
        if [[ $system_site == "$wanted_site" && -x $VENV_DIR/bin/skyfed && -f $VENV_DIR/.skyfed-install ]] &&
            [[ $(cat "$VENV_DIR/.skyfed-install") == "$stamp" ]]; then
            say "venv $VENV: up to date"
            return
        fi
    fi
    say "venv $VENV: installing SkyFed$(extras) (--torch $TORCH) with $(basename "$CONSTRAINTS")"
    if [[ $system_site != "$wanted_site" ]] || ! venv_matches_python; then
        local -a venv_args=(--clear)
        [[ $wanted_site == false ]] || venv_args+=(--system-site-packages)
        mkdir -p "$(dirname "$VENV_DIR")"
        "$PYTHON" -m venv "${venv_args[@]}" "$VENV_DIR"
    fi
    if [[ -z $WHEEL ]]; then
        pip_quiet wheel --quiet --no-deps --wheel-dir "$STAGE/dist" "$STAGE/src"
        wheels=("$STAGE"/dist/skyfed-*.whl)
        WHEEL=${wheels[0]}
    fi
    link_deps
    if ((NO_DEPS == 0)); then
        local -a index=()
        [[ $TORCH_INDEX == none ]] || index=(--extra-index-url "$TORCH_INDEX")
        pip_quiet install --quiet "${index[@]}" -c "$STAGED_CONSTRAINTS" "$WHEEL$(extras)"
    fi
    pip_quiet install --quiet --no-deps --force-reinstall "$WHEEL"
    ((NO_DEPS == 0)) || check_deps
    if [[ $TORCH == system ]] && ((NO_DEPS == 0)); then
        "$VENV_DIR/bin/python" -c 'import torch' || die "the venv cannot import the system's torch"
    fi
    (cd / && "$VENV_DIR/bin/skyfed" --help >/dev/null) || die "$VENV_DIR/bin/skyfed --help fails: the install is broken"
    printf '%s\n' "$stamp" >"$VENV_DIR/.skyfed-install.tmp"
    mv -f "$VENV_DIR/.skyfed-install.tmp" "$VENV_DIR/.skyfed-install"
    SERVICE_CHANGED=1
}

# The daemon's own loader on the provisioning folder's config, with the installed SkyFed: a missing data
# file is reported (check_data_ref), anything else stops the install before the config is installed.
check_config_with_loader() {
    local out
    if ! out=$(cd / && "$VENV_DIR/bin/python" - "$ROLE" "$PROV/$CONFIG_NAME" 2>&1 <<'PY'
import sys
from pathlib import Path

from protocol.config import ConfigError

role, path = sys.argv[1], Path(sys.argv[2])
if role == "agent":
    from agent.config import load_agent_config as load
    data_key = "agent.data"
else:
    from broker_server.config import load_server_config as load
    data_key = "server.eval_data"
try:
    load(path)
except ConfigError as exc:
    if f": {data_key} = " not in str(exc):
        sys.exit(str(exc))
PY
    ); then
        die "$PROV/$CONFIG_NAME does not load with the installed SkyFed: $out"
    fi
}

# --- config, unit, service ----------------------------------------------------------------------------
is_private() {
    local rel=$1 ref
    [[ $rel == *.key ]] && return 0
    for ref in "${PRIVATE_REFS[@]}"; do
        [[ $ref == "$rel" ]] && return 0
    done
    return 1
}

# Nodes the provisioning folder lists as revoked (enrolled/revoked/<id>.pub: agents of a server, or peers)
# leave the installed enrolled folder (keys.enrolled): copying the folder alone would keep trusting them.
revoke_enrolled() {
    [[ -n $ENROLLED ]] || return 0
    [[ $ENROLLED != /* || $ENROLLED == "$ETC"/* ]] || return 0
    local rel=${ENROLLED#"$ETC"/} revoked name installed
    rel=${rel#./}
    for revoked in "$PROV/$rel"/revoked/*.pub; do
        [[ -f $revoked ]] || continue
        name=$(basename "$revoked")
        installed=$(at "$ETC/$rel/$name")
        if [[ -f $installed ]]; then
            rm -f "$installed"
            say "  revoked ${name%.pub}: removed $installed (the running $ROLE stops trusting it within a second)"
        fi
    done
}

install_config() {
    local etc rel owner=0:$SKYFED_GID
    etc=$(at "$ETC")
    ensure_dir "$etc" 0750 "$owner"
    while IFS= read -r -d '' rel; do
        rel=${rel#./}
        if [[ -d $PROV/$rel ]]; then
            ensure_dir "$etc/$rel" 0750 "$owner"
        elif is_private "$rel"; then
            put_file "$PROV/$rel" "$etc/$rel" 0600 "$SKYFED_UID:$SKYFED_GID" keep && SERVICE_CHANGED=1
        else
            put_file "$PROV/$rel" "$etc/$rel" 0640 "$owner" keep && SERVICE_CHANGED=1
        fi
    done < <(cd "$PROV" && find . -mindepth 1 -name '.*' -prune -o -print0 | LC_ALL=C sort -z)
    return 0
}

install_readme() {
    local readme
    readme=$STAGE/README.md
    if [[ -d $SOURCE ]]; then
        cp "$SOURCE/README.md" "$readme"
    else
        "$PYTHON" - "$SOURCE" "$readme" <<'PY'
import sys
import zipfile

# the wheel's METADATA: headers, a blank line, then the long description (the README)
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name)
with open(sys.argv[2], "wb") as out:
    out.write(metadata.partition(b"\n\n")[2])
PY
    fi
    put_file "$readme" "$(at "$(dirname "$VENV")")/README.md" 0644 0:0 || true
}

# Whether systemd manages this system now (sd_booted(3)); not in a chroot, a container or an image build.
systemd_running() { [[ -d /run/systemd/system ]]; }

install_unit() {
    ensure_dir "$(at /etc/systemd/system)" 0755 0:0
    if put_file "$DEPLOY_DIR/systemd/$UNIT" "$(at "/etc/systemd/system/$UNIT")" 0644 0:0; then
        SERVICE_CHANGED=1
        [[ -n $ROOT ]] || ! systemd_running || systemctl daemon-reload
    fi
}

start_service() {
    if ((NO_START == 1)); then
        say "$UNIT: installed, not enabled (--no-start): systemctl enable --now $UNIT"
        return
    fi
    if [[ -n $ROOT ]]; then
        if ! command -v systemctl >/dev/null; then
            note "no systemctl here: $UNIT is not enabled in $ROOT"
        elif ! systemctl --root="$ROOT" is-enabled --quiet "$UNIT" 2>/dev/null; then
            systemctl --root="$ROOT" --quiet enable "$UNIT" 2>/dev/null
            say "  enabled $UNIT in $ROOT (not started: --root)"
        fi
        return
    fi
    if ! systemd_running; then
        note "systemd is not running here (a chroot, container or image build): $UNIT is installed, not enabled;" \
            "on the booted device: systemctl enable --now $UNIT"
        return
    fi
    systemctl is-enabled --quiet "$UNIT" || systemctl enable "$UNIT"
    if [[ -n $DATA_MISSING ]]; then
        say "$UNIT: enabled, not started: no data at $DATA_MISSING yet; then: systemctl start $UNIT"
        return
    fi
    if ((SERVICE_CHANGED == 0)) && systemctl is-active --quiet "$UNIT"; then
        say "$UNIT: running, nothing changed"
        return
    fi
    # --no-block: Type=notify sends READY=1 once the broker accepted the daemon, which may take a while
    # (a drone out of range); a bad config or a crash shows as failed within seconds.
    systemctl restart --no-block "$UNIT"
    local state="" i
    for i in 1 2 3 4 5 6 7 8 9 10; do
        sleep 1
        state=$(systemctl is-active "$UNIT" || true)
        [[ $state == activating || $state == reloading ]] || break
    done
    case $state in
    active) say "$UNIT: running and connected to its broker (journalctl -u $UNIT -f)" ;;
    activating | reloading) say "$UNIT: started, waiting for its broker after ${i}s (systemctl status $UNIT)" ;;
    *) die "$UNIT did not start ($state): journalctl -u $UNIT -n 50" ;;
    esac
}

# --- install and uninstall ----------------------------------------------------------------------------
install_main() {
    parse_options "$@"
    check_root_and_target
    [[ -f $DEPLOY_DIR/systemd/$UNIT ]] || die "$DEPLOY_DIR/systemd/$UNIT is missing"
    if ((UNINSTALL == 1)); then
        uninstall
        return
    fi
    VENV=$(venv_of_unit "$DEPLOY_DIR/systemd/$UNIT")
    check_provisioning_folder
    check_python
    check_torch
    check_source
    check_extra_groups
    role_precheck
    say "installing SkyFed $ROLE from $PROV into ${ROOT:-/}"
    ensure_venv
    check_config_with_loader
    ensure_user
    ensure_state_dirs
    install_config
    role_install
    install_readme
    install_unit
    start_service
    role_summary
}

# Removes the unit and the venv (kept while the other role's unit still uses it); with --purge also
# /etc/skyfed, /var/lib/skyfed and the user. --purge is refused while the other role is installed here:
# both share those.
uninstall() {
    local unit_path venv other
    unit_path=$(at "/etc/systemd/system/$UNIT")
    other=$(at "/etc/systemd/system/$OTHER_UNIT")
    if ((PURGE == 1)) && [[ -e $other ]]; then
        die "$OTHER_UNIT is installed here too and shares $ETC, $STATE and the user: uninstall it first, or drop --purge"
    fi
    if [[ -f $unit_path ]]; then venv=$(venv_of_unit "$unit_path"); else venv=$(venv_of_unit "$DEPLOY_DIR/systemd/$UNIT"); fi
    if [[ -z $ROOT && -f $unit_path ]]; then
        systemctl disable --now "$UNIT" || true
    elif [[ -f $unit_path ]] && command -v systemctl >/dev/null; then
        systemctl --root="$ROOT" --quiet disable "$UNIT" 2>/dev/null || true
    fi
    if [[ -f $unit_path ]]; then
        rm -f "$unit_path"
        say "  removed $unit_path"
    fi
    role_uninstall
    [[ -n $ROOT ]] || ! systemd_running || systemctl daemon-reload
    if [[ -e $other ]]; then
        say "  kept $(at "$venv"): $OTHER_UNIT uses it"
    else
        remove_tree "$(at "$venv")"
        rm -f "$(at "$(dirname "$venv")")/README.md"
        rmdir "$(at "$(dirname "$venv")")" 2>/dev/null || true
    fi
    if ((PURGE == 0)); then
        say "kept $(at "$ETC") (config, keys), $(at "$STATE") (state, data) and the user $USER_NAME: --uninstall --purge removes them"
        return
    fi
    remove_tree "$(at "$ETC")"
    remove_tree "$(at "$STATE")"
    if [[ -n $(uid_of "$USER_NAME") ]]; then
        local -a prefix
        mapfile -t prefix < <(prefix_args)
        userdel "${prefix[@]}" "$USER_NAME"
        say "  removed user $USER_NAME"
    fi
    if [[ -n $(gid_of "$USER_NAME") ]]; then
        local -a prefix
        mapfile -t prefix < <(prefix_args)
        groupdel "${prefix[@]}" "$USER_NAME"
    fi
}

remove_tree() {
    [[ -e $1 || -L $1 ]] || return 0
    rm -rf "$1"
    say "  removed $1"
}
