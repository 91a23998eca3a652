"""What ``skyfed server check`` and the server's start say about a loaded ``server.toml``."""

from __future__ import annotations

from broker_server.config import ServerConfig

NO_EVAL_DATA = (
    "server.eval_data is not set: no round is evaluated, so accuracy (mAP for detectors) is never measured "
    "and no best model is elected; set server.eval_data to a validation set (an .npz with x, y for classifiers, "
    "a YOLO data.yaml for detectors)"
)


def server_summary(config: ServerConfig) -> str:
    s, b = config.server, config.broker
    return (
        f"federation={s.federation} model={s.model} rounds={s.rounds or 'forever'} broker={b.address_list} "
        f"tls={'yes' if b.tls else 'no'} state_dir={config.state_dir} eval_data={config.eval_path or 'none'}"
        + (f" pool={config.pool_path}" if config.pool.enabled else "")
        + _async_summary(config)
        + (f" upstream={u.id}@{u.federation}" if (u := config.upstream) is not None else "")
        + config.metrics.summary()
    )


def _async_summary(config: ServerConfig) -> str:
    r = config.rounds
    if not r.is_async:
        return ""
    return (f" mode=async buffer={r.buffer} staleness={r.staleness} max_staleness={r.max_staleness} "
            f"max_concurrent={r.max_concurrent or 'all'} server_lr={r.server_lr:g}")


def server_warnings(config: ServerConfig) -> list[str]:
    """What loads but is likely a mistake: said at start, by ``skyfed server check`` and by provision."""
    from flcore.strategies import build_strategy

    strategy = build_strategy(config.privacy.strategy_table(config.strategy)[0])
    return ([] if config.server.eval_data else [NO_EVAL_DATA]) + strategy.run_warnings(config.server.rounds)
