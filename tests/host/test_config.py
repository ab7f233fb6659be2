"""apir.host.config: every host key in one module, each with its environment fallback read by
both readers (HostContext.get_config and config_limit); the codec names none of them."""

import apir.codec.constants as codec_constants
from apir.host import HostContext, config


def _keys():
    return {name: value for name, value in vars(config).items() if name.startswith("CONFIG_KEY_")}


def test_keys_are_distinct_and_named_for_their_part():
    keys = _keys()
    assert len(set(keys.values())) == len(keys)
    for value in keys.values():
        assert value.split(".")[0] in ("apir", "ggml"), value
    assert set(config.ENV_FALLBACKS) <= set(keys.values())
    assert len(set(config.ENV_FALLBACKS.values())) == len(config.ENV_FALLBACKS)


def test_the_codec_holds_no_configuration():
    names = [n for n in vars(codec_constants) if n.startswith(("CONFIG_KEY_", "ENV_"))]
    assert names == []


def test_every_fallback_is_read_by_the_context(monkeypatch):
    ctx = HostContext(1)
    for key, env in config.ENV_FALLBACKS.items():
        monkeypatch.setenv(env, f"from {env}")
        assert ctx.get_config(key) == f"from {env}"
        ctx.set_config(key, "set")
        assert ctx.get_config(key) == "set"  # the configuration first
    ctx.close()


def test_config_limit_reads_configuration_then_environment_then_default(monkeypatch):
    key = config.CONFIG_KEY_MAX_BLOBS
    monkeypatch.delenv(config.ENV_FALLBACKS[key], raising=False)
    assert config.config_limit(None, key, config.DEFAULT_MAX_BLOBS) == 1024
    monkeypatch.setenv(config.ENV_FALLBACKS[key], "7")
    assert config.config_limit(None, key, config.DEFAULT_MAX_BLOBS) == 7
    assert config.config_limit({key: "9"}, key, config.DEFAULT_MAX_BLOBS) == 9
    assert config.config_limit({key: "-1"}, key, config.DEFAULT_MAX_BLOBS) == 1024  # logged, default
