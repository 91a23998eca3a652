#!/usr/bin/env bash
# Install the SkyFed edge agent on this device as the systemd service skyfed-agent, from its provisioning
# folder (fleet-pki/agents/<id>/ as skyfed provision writes it: agent.toml, <id>.key, server.pub, TLS
# files; or a peer's, fleet-pki/peers/<id>/ from skyfed provision --mode peer, with enrolled/ for server.pub). Run it again at will: a second run changes nothing. What goes where: deploy/install-common.sh.
#
#   sudo deploy/install-agent.sh [options] PROVISIONING_FOLDER
#   sudo deploy/install-agent.sh --uninstall [--purge]
set -euo pipefail

ROLE=agent
CONFIG_NAME=agent.toml
UNIT=skyfed-agent.service
OTHER_UNIT=skyfed-server.service
EXTRA_GROUPS=(dialout) # serial flight controllers and telemetry radios (MAVLink over pyserial)

role_usage() {
    cat <<'EOF'
usage: install-agent.sh [options] PROVISIONING_FOLDER
       install-agent.sh --uninstall [--purge] [--root DIR]

Installs the SkyFed edge agent as the systemd service skyfed-agent: the system user skyfed (no login
shell, home /var/lib/skyfed, in group dialout), a venv in /opt/skyfed, the folder's config and keys in
/etc/skyfed (private keys 0600 skyfed, the rest 0640 root:skyfed), the unit in /etc/systemd/system
(on a Jetson with its jetson-gpu.conf drop-in); then enables and starts it (not before agent.data
exists). PROVISIONING_FOLDER is the device's folder from `skyfed provision` (fleet-pki/agents/<id>/),
or one made by hand: agent.toml and the keys it names.

EOF
}
role_example() { printf 'agents/drone-01/'; }
role_option() { ROLE_SHIFT=0; }

role_check_config() {
    check_key_ref keys identity "agent key file" private
    if [[ $(toml_get "$PROV/$CONFIG_NAME" federation mode) == peer ]]; then # no server: every peer's key
        check_key_ref keys enrolled "enrolled-peers folder" public d
        ENROLLED=$(toml_get "$PROV/$CONFIG_NAME" keys enrolled)
        check_data_ref agent test_data # its validation split: the peer refuses to start without it
    else
        check_key_ref keys server "server public key" public
    fi
    check_state_dir agent
    check_data_ref agent data
}

role_precheck() { :; }

# On a Jetson the unit's DevicePolicy=closed hides the integrated GPU: the drop-in lets it through.
DROP_IN=/etc/systemd/system/skyfed-agent.service.d/jetson-gpu.conf

role_install() {
    revoke_enrolled
    is_jetson || return 0
    ensure_dir "$(at "$(dirname "$DROP_IN")")" 0755 0:0
    if put_file "$DEPLOY_DIR/systemd/jetson-gpu.conf" "$(at "$DROP_IN")" 0644 0:0; then
        SERVICE_CHANGED=1
        [[ -n $ROOT ]] || systemctl daemon-reload
    fi
}

role_uninstall() {
    [[ -e $(at "$DROP_IN") ]] || return 0
    rm -f "$(at "$DROP_IN")"
    rmdir "$(at "$(dirname "$DROP_IN")")" 2>/dev/null || true
    say "  removed $(at "$DROP_IN")"
}
role_summary() {
    say "done: skyfed-agent runs $VENV/bin/skyfed agent run --config $ETC/agent.toml as $USER_NAME"
}

# shellcheck source=deploy/install-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/install-common.sh"
install_main "$@"
