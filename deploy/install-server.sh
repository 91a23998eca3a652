#!/usr/bin/env bash
# Install the SkyFed aggregator next to the MQTT broker as the systemd service skyfed-server, from its
# provisioning folder (fleet-pki/server/ as skyfed provision writes it: server.toml, server.key,
# enrolled/, TLS files), and mosquitto's SkyFed config from fleet-pki/broker/. Run it again at will: a
# second run changes nothing. What goes where: deploy/install-common.sh.
#
#   sudo deploy/install-server.sh [options] PROVISIONING_FOLDER
#   sudo deploy/install-server.sh --uninstall [--purge]
set -euo pipefail

ROLE=server
CONFIG_NAME=server.toml
UNIT=skyfed-server.service
OTHER_UNIT=skyfed-agent.service
DASHBOARD_UNIT=skyfed-dashboard.service
EXTRA_GROUPS=()
MOSQUITTO=""       # --mosquitto: a provisioned broker folder, plain or none
MOSQUITTO_USER=mosquitto
BROKER_RESTART=0   # the listener, certificates or conf.d changed: restart mosquitto
BROKER_RELOAD=0    # only the ACL or the CRL changed: a reload applies them

role_usage() {
    cat <<'EOF'
usage: install-server.sh [options] PROVISIONING_FOLDER
       install-server.sh --uninstall [--purge] [--root DIR]

Installs the SkyFed aggregator as the systemd service skyfed-server: the system user skyfed (no login
shell, home /var/lib/skyfed), a venv in /opt/skyfed, the folder's config, keys and enrolled/ in
/etc/skyfed (private keys 0600 skyfed, the rest 0640 root:skyfed; agents the folder lists as revoked
are taken out of /etc/skyfed/enrolled), the unit in /etc/systemd/system, and mosquitto's SkyFed config;
then (re)starts mosquitto and enables and starts the server. The dashboard's unit (skyfed-dashboard) is
installed too, and enabled and started, with a drop-in naming the federation, the broker and its
WebSockets port, where the broker folder has a WebSockets listener (skyfed provision --ws-port). PROVISIONING_FOLDER is fleet-pki/server/
from `skyfed provision`, or one made by hand: server.toml and the keys and enrolled/ folder it names.

server options:
  --mosquitto DIR|plain|none  mosquitto's SkyFed config: DIR is the provisioned broker folder
                        (fleet-pki/broker/: mutual TLS, ACL, CRL), installed where its skyfed.conf says
                        (skyfed provision --broker-dir, e.g. /etc/mosquitto/skyfed) and linked into
                        /etc/mosquitto/conf.d/; plain is deploy/mosquitto/plain.conf (plain MQTT on
                        1883, trusted networks only); none leaves mosquitto alone. Default: the broker/
                        folder next to PROVISIONING_FOLDER when there is one.
                        --uninstall removes the conf.d entry (and, with --purge, the broker folder
                        when it lies under /etc/mosquitto).

EOF
}
role_example() { printf 'server/'; }

role_option() {
    ROLE_SHIFT=0
    if [[ $1 == --mosquitto ]]; then
        MOSQUITTO=${2:?--mosquitto needs a broker folder, plain or none}
        ROLE_SHIFT=2
    fi
}

role_check_config() {
    check_key_ref keys identity "server key file" private
    check_key_ref keys enrolled "enrolled-agents folder" public d
    ENROLLED=$(toml_get "$PROV/$CONFIG_NAME" keys enrolled)
    local init
    init=$(toml_get "$PROV/$CONFIG_NAME" server init_weights)
    [[ -z $init ]] || resolve_ref server.init_weights "$init" "Ultralytics .pt checkpoint" >/dev/null
    check_state_dir server
    check_data_ref server eval_data
    [[ -n $(toml_get "$PROV/$CONFIG_NAME" server eval_data) ]] ||
        note "server.eval_data is not set in $ETC/$CONFIG_NAME: no round is evaluated (no accuracy or mAP, no best model);" \
            "put a validation set (.npz with x, y, or a YOLO data.yaml) under $STATE/server, set eval_data, then: systemctl restart $UNIT"
}

# The directory a provisioned skyfed.conf names for its files (acl_file, cafile, ...): all in one folder.
broker_target() {
    local conf=$1 dir="" key path
    for key in acl_file cafile certfile keyfile crlfile; do
        path=$(sed -n "s/^${key}[[:space:]]\{1,\}//p" "$conf" | head -n1)
        [[ -n $path ]] || die "$conf has no $key line: is it skyfed provision's skyfed.conf?"
        [[ $path == /* ]] || die "$conf: $key $path is not an absolute path"
        [[ -z $dir || $(dirname "$path") == "$dir" ]] || die "$conf: its files are not in one folder ($dir, $path)"
        dir=$(dirname "$path")
        [[ -f $MOSQUITTO/$(basename "$path") ]] || die "$MOSQUITTO has no $(basename "$path") ($conf names it)"
    done
    printf '%s\n' "$dir"
}

role_precheck() {
    if [[ -z $MOSQUITTO ]]; then
        if [[ -f $PROV/../broker/skyfed.conf ]]; then
            MOSQUITTO=$(realpath "$PROV/../broker")
            say "mosquitto: the broker folder next to $PROV ($MOSQUITTO); --mosquitto chooses another"
        else
            die "no broker folder next to $PROV: pass --mosquitto DIR (fleet-pki/broker/), --mosquitto plain" \
                "(plain MQTT, trusted networks only) or --mosquitto none (the broker is managed elsewhere)"
        fi
    fi
    [[ $MOSQUITTO != none ]] || return 0
    [[ -d $(at /etc/mosquitto/conf.d) ]] ||
        die "mosquitto is not installed here (no $(at /etc/mosquitto/conf.d)): apt-get install mosquitto, or --mosquitto none"
    [[ $MOSQUITTO == plain ]] && return 0
    [[ -f $MOSQUITTO/skyfed.conf ]] || die "--mosquitto $MOSQUITTO: no skyfed.conf there (pass fleet-pki/broker/)"
    MOSQUITTO=$(realpath "$MOSQUITTO")
    BROKER_DIR=$(broker_target "$MOSQUITTO/skyfed.conf")
    [[ -n $(uid_of "$MOSQUITTO_USER") ]] ||
        die "user $MOSQUITTO_USER does not exist on $(at /): is mosquitto installed (apt-get install mosquitto)?"
    if [[ -z $ROOT ]] && [[ -f /etc/mosquitto/mosquitto.conf ]] &&
        ! grep -q '^include_dir[[:space:]]\{1,\}/etc/mosquitto/conf.d' /etc/mosquitto/mosquitto.conf; then
        note "/etc/mosquitto/mosquitto.conf has no 'include_dir /etc/mosquitto/conf.d': add it, or mosquitto ignores SkyFed's config"
    fi
}

install_broker_tls() {
    local target conf_d file name
    target=$(at "$BROKER_DIR")
    conf_d=$(at /etc/mosquitto/conf.d)
    if [[ $(realpath -m "$target") != "$MOSQUITTO" ]]; then
        local owner
        owner=$(uid_of "$MOSQUITTO_USER"):$(primary_gid_of "$MOSQUITTO_USER")
        ensure_dir "$target" 0700 "$owner"
        for file in "$MOSQUITTO"/*; do
            [[ -f $file ]] || continue
            name=$(basename "$file")
            if put_file "$file" "$target/$name" 0600 "$owner"; then
                case $name in
                skyfed.acl | crl.pem) BROKER_RELOAD=1 ;;
                *) BROKER_RESTART=1 ;;
                esac
            fi
        done
    else
        say "  broker folder used in place: $MOSQUITTO"
    fi
    ensure_link "$BROKER_DIR/skyfed.conf" "$conf_d/skyfed.conf" && BROKER_RESTART=1
    if [[ -f $conf_d/skyfed-plain.conf ]]; then
        rm -f "$conf_d/skyfed-plain.conf"
        say "  removed $conf_d/skyfed-plain.conf (TLS replaces plain MQTT)"
        BROKER_RESTART=1
    fi
    return 0
}

install_broker_plain() {
    local conf_d
    conf_d=$(at /etc/mosquitto/conf.d)
    put_file "$DEPLOY_DIR/mosquitto/plain.conf" "$conf_d/skyfed-plain.conf" 0644 0:0 && BROKER_RESTART=1
    if [[ -L $conf_d/skyfed.conf || -f $conf_d/skyfed.conf ]]; then
        rm -f "$conf_d/skyfed.conf"
        say "  removed $conf_d/skyfed.conf (plain MQTT replaces TLS)"
        BROKER_RESTART=1
    fi
    note "plain MQTT on port 1883 for anyone who can reach it: on a trusted network only (deploy/mosquitto/plain.conf)"
    return 0
}

apply_broker() {
    ((BROKER_RESTART + BROKER_RELOAD > 0)) || return 0
    local action=reload
    ((BROKER_RESTART == 0)) || action=restart
    if [[ -n $ROOT ]] || ((NO_START == 1)); then
        say "mosquitto: its config changed; apply it with: systemctl $action mosquitto"
        return
    fi
    systemctl "$action" mosquitto || die "mosquitto did not $action: journalctl -u mosquitto -n 50"
    say "mosquitto: ${action}ed"
}

role_install() {
    revoke_enrolled
    case $MOSQUITTO in
    none) say "mosquitto: left alone (--mosquitto none)" ;;
    plain) install_broker_plain ;;
    *) install_broker_tls ;;
    esac
    apply_broker
    install_dashboard
}

# The port of the provisioned broker's WebSockets listener (skyfed provision --ws-port), or nothing.
ws_port_of() {
    [[ $MOSQUITTO != none && $MOSQUITTO != plain ]] || return 0
    awk '$1 == "listener" { port = $2 } $1 == "protocol" && $2 == "websockets" { print port; exit }' \
        "$MOSQUITTO/skyfed.conf"
}

# skyfed-dashboard: the unit always (inert until enabled); with a WebSockets listener also a drop-in naming
# this federation, its broker and that port, and the unit enabled and (re)started.
install_dashboard() {
    local unit_dir dropin ws_port changed=0
    unit_dir=$(at /etc/systemd/system)
    ensure_dir "$unit_dir" 0755 0:0
    put_file "$DEPLOY_DIR/systemd/$DASHBOARD_UNIT" "$unit_dir/$DASHBOARD_UNIT" 0644 0:0 && changed=1
    ws_port=$(ws_port_of)
    if [[ -z $ws_port ]]; then
        say "$DASHBOARD_UNIT: installed, not enabled: the broker has no WebSockets listener (skyfed provision" \
            "--ws-port, docs/dashboard.md)"
        ((changed == 0)) || [[ -n $ROOT ]] || systemctl daemon-reload
        return 0
    fi
    dropin=$STAGE/dashboard.conf
    printf '# written by deploy/install-server.sh from %s: run it again to update\n[Service]\n' "$PROV" >"$dropin"
    printf 'Environment=SKYFED_BROKER=%s:%s SKYFED_WS_PORT=%s SKYFED_FEDERATION=%s\n' \
        "$(toml_get "$PROV/$CONFIG_NAME" broker host)" "$(toml_get "$PROV/$CONFIG_NAME" broker port)" "$ws_port" \
        "$(toml_get "$PROV/$CONFIG_NAME" server federation)" >>"$dropin"
    ensure_dir "$unit_dir/$DASHBOARD_UNIT.d" 0755 0:0
    put_file "$dropin" "$unit_dir/$DASHBOARD_UNIT.d/skyfed.conf" 0644 0:0 && changed=1
    if ((NO_START == 1)); then
        say "$DASHBOARD_UNIT: installed, not enabled (--no-start): systemctl enable --now $DASHBOARD_UNIT"
    elif [[ -n $ROOT ]]; then
        command -v systemctl >/dev/null && ! systemctl --root="$ROOT" is-enabled --quiet "$DASHBOARD_UNIT" 2>/dev/null &&
            systemctl --root="$ROOT" --quiet enable "$DASHBOARD_UNIT" 2>/dev/null &&
            say "  enabled $DASHBOARD_UNIT in $ROOT (not started: --root)"
    else
        ((changed == 0)) || systemctl daemon-reload
        systemctl is-enabled --quiet "$DASHBOARD_UNIT" || systemctl enable "$DASHBOARD_UNIT"
        if ((changed == 1)) || ! systemctl is-active --quiet "$DASHBOARD_UNIT"; then
            systemctl restart "$DASHBOARD_UNIT" || die "$DASHBOARD_UNIT did not start: journalctl -u $DASHBOARD_UNIT -n 50"
        fi
        say "$DASHBOARD_UNIT: serves the page on 127.0.0.1:8080 (systemctl edit $DASHBOARD_UNIT to change it)"
    fi
    return 0
}

role_uninstall() {
    local conf_d link_target="" dashboard
    dashboard=$(at "/etc/systemd/system/$DASHBOARD_UNIT")
    if [[ -f $dashboard ]]; then
        if [[ -z $ROOT ]]; then
            systemctl disable --now "$DASHBOARD_UNIT" || true
        elif command -v systemctl >/dev/null; then
            systemctl --root="$ROOT" --quiet disable "$DASHBOARD_UNIT" 2>/dev/null || true
        fi
        rm -rf "$dashboard" "$dashboard.d"
        say "  removed $dashboard"
    fi
    conf_d=$(at /etc/mosquitto/conf.d)
    [[ -d $conf_d ]] || return 0
    if [[ -L $conf_d/skyfed.conf ]]; then
        link_target=$(readlink "$conf_d/skyfed.conf")
        rm -f "$conf_d/skyfed.conf"
        say "  removed $conf_d/skyfed.conf"
        BROKER_RESTART=1
    fi
    if [[ -f $conf_d/skyfed-plain.conf ]]; then
        rm -f "$conf_d/skyfed-plain.conf"
        say "  removed $conf_d/skyfed-plain.conf"
        BROKER_RESTART=1
    fi
    if [[ -n $link_target ]]; then
        if ((PURGE == 1)) && [[ $link_target == /etc/mosquitto/?*/skyfed.conf ]]; then
            remove_tree "$(at "$(dirname "$link_target")")"
        else
            say "  kept the broker folder $(dirname "$link_target") (--purge removes it when it lies under /etc/mosquitto)"
        fi
    fi
    apply_broker
}

role_summary() {
    say "done: skyfed-server runs $VENV/bin/skyfed server run --config $ETC/server.toml --keep-running as $USER_NAME"
}

# shellcheck source=deploy/install-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/install-common.sh"
install_main "$@"
