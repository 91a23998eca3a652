"""``server.toml``'s checks across sections (``broker_server.config.load_server_config`` runs them at start): each
says why one part of the configuration does not fit the rest, naming the keys and the fix, or returns ``""``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_server.config import POOL, POOL_NAME_TAKEN

if TYPE_CHECKING:
    from broker_server.config import ServerConfig, ServerSection
    from flcore.strategies.base import Strategy
    from protocol.messages import TrainSettings


def upstream_problem(config: ServerConfig) -> str:
    """Why ``[upstream]`` does not fit the rest of the configuration, or ``""``."""
    from flcore.strategies import build_strategy
    from flcore.strategies.capabilities import averaging_choices

    upstream = config.upstream
    if upstream is None:
        return ""
    if config.server.rounds != 0:
        return (f"server.rounds = {config.server.rounds} with [upstream]: a region runs one round for each round "
                "of the root, for as long as the root runs; set server.rounds = 0")  # fmt: skip
    if upstream.broker is None and upstream.federation == config.server.federation:
        return (f"upstream.federation and server.federation are both {upstream.federation!r}: over a bridged broker "
                "the region's agents and the root's participants would share topics; give the region its own "
                "federation name")  # fmt: skip
    if build_strategy(config.privacy.strategy_table(config.strategy)[0]).keeps_models:
        return ("[upstream] with a strategy that gives each agent its own model: a region sends the root one "
                f"aggregate; choose an averaging strategy ({averaging_choices()})")  # fmt: skip
    config.upstream_keys  # noqa: B018 - fail now
    return ""


def pool_problem(config: ServerConfig) -> str:
    """Why ``[pool]`` does not fit the rest of the configuration, or ``""``."""
    from flcore.strategies import build_strategy
    from flcore.strategies.capabilities import averaging_choices
    from models.datasets import load_dataset
    from models.tasks import task_of
    from security.keys import Keyring

    if (path := config.pool_path) is None:
        return ""
    if task_of(config.server.model) != "classify":
        return (f"pool.data is a classifier .npz and server.model {config.server.model} is a detector: remove [pool] "
                "or choose a classifier model")  # fmt: skip
    strategy = build_strategy(config.privacy.strategy_table(config.strategy)[0])
    if strategy.keeps_models:
        return (f"[pool] with strategy {strategy.name}: the strategy gives every participant its own start model, "
                f"and the pool trains from the global model: choose an averaging strategy ({averaging_choices()}) or "
                "remove [pool]")  # fmt: skip
    if POOL in Keyring.load_dir(config.enrolled_dir).names():
        return f"an agent is enrolled as {POOL!r}: {POOL_NAME_TAKEN}"
    try:
        data = load_dataset(path)
    except ValueError as exc:
        return f"pool.data: {exc}"
    if not len(data):
        return f"pool.data = {config.pool.data!r} holds no samples: give it some, or remove [pool]"
    if int(data.y.max()) >= config.server.num_classes:
        return (f"pool.data holds label {int(data.y.max())}, and server.num_classes is {config.server.num_classes}: "
                "labels must be 0 .. num_classes - 1")  # fmt: skip
    return ""


def model_problem(server: ServerSection) -> str:
    """Why ``server.model`` names no model the server can build, or ``""``: a zoo name, or the operator's own
    ``package.module:function`` (imported here, from the operator's own config only; docs/own-model.md)."""
    from models.own import is_reference
    from models.tasks import CLASSIFIERS, YOLO_YAMLS, is_model_file  # the zoo's names, without importing PyTorch

    if is_model_file(server.model):  # the operator's own detector: built here once, so a bad file fails at start
        from models.yolo import model_file_problem

        return model_file_problem(server.model, "server.model", max(1, len(server.classes)))
    if is_reference(server.model):
        from models.own import check_own_model

        try:
            check_own_model(server.model, server.num_classes, "server.model")
        except ValueError as exc:
            return str(exc)
        return ""
    if server.model not in (*CLASSIFIERS, *YOLO_YAMLS):
        return (f"server.model {server.model!r} is unknown; choose one of {sorted([*CLASSIFIERS, *YOLO_YAMLS])} "
                'or your own "package.module:function" (docs/own-model.md)')
    return ""


def recipe_problem(strategy: Strategy, training: TrainSettings, trainer: str) -> str:
    """Why a ``trainer``'s participants could not follow the recipes ``strategy`` asks for, or ``""``: found at start
    instead of every participant declining every round."""
    from participant.recipes import refusal

    plan = strategy.configure_train(training, 1, {})
    for settings in (plan.shared, *plan.agents.values()):
        for record in settings.recipes:
            if why := refusal(record, trainer):
                return f"strategy {strategy.name}: {why}"
    return ""


def task_problem(config: ServerConfig) -> str:
    """Why the model's task (classify or detect) does not fit the rest of the configuration, or ``""``."""
    from flcore.strategies import build_strategy
    from flcore.strategies.capabilities import task_refusal
    from models.tasks import PARTS, task_of

    server = config.server
    strategy = build_strategy(config.privacy.strategy_table(config.strategy)[0])
    if refusal := task_refusal(type(strategy), task_of(server.model)):
        return refusal
    if task_of(server.model) == "classify":
        if server.classes or server.init_weights or server.share != "full":
            return f"server.classes, init_weights and share are for detector models; {server.model} is a classifier"
        return ""
    if server.share not in PARTS:
        return f"server.share must be one of {', '.join(PARTS)}, got {server.share!r}"
    if server.share != "full" and strategy.keeps_models:
        return (
            "server.share = backbone/head keeps part of each model on its agent; swapping strategies move whole models"
        )
    if not server.classes:
        return (f'server.classes must name the classes of detector {server.model}, in id order, e.g. classes = '
                '["car", "truck", "person"] (the names in your data.yaml)')  # fmt: skip
    if config.training.optimizer != "sgd":
        return (f"training.optimizer = {config.training.optimizer!r} is for classifier models; the detector trainer "
                f"runs Ultralytics' SGD: remove training.optimizer or choose a classifier model")  # fmt: skip
    if problem := recipe_problem(strategy, config.training, "detector"):
        return f"{problem}: choose another strategy or a classifier model"
    if config.eval_path is not None and config.eval_path.suffix not in (".yaml", ".yml"):
        return f"server.eval_data must be a YOLO data.yaml for detector {server.model}, got {config.eval_path.name}"
    if config.eval_path is not None:
        from models.yolo_dataset import DatasetError, load_data_yaml

        try:
            names = load_data_yaml(config.eval_path).names
        except DatasetError as exc:
            return f"server.eval_data: {exc}"
        if list(names) != server.classes:
            return f"server.eval_data names classes {list(names)} but server.classes is {server.classes}"
    return ""
