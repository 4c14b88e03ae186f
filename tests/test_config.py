"""CompilerConfig: nested groups, the flat option table, environment overrides and strict errors."""
import pytest

from npu_graph import CompilerConfig, ConfigError, get_backend
from npu_graph.config import FLAT_OPTIONS, valid_option_names


def test_defaults_and_nested_access():
    c = CompilerConfig()
    assert c.target == "cpu" and c.debug.graph_dump.path is None and c.streams.count == 3
    c.debug.graph_dump.path = "/tmp/x"
    assert c.get("debug.graph_dump.path") == "/tmp/x"


def test_flat_options_map_onto_nested_paths():
    c = CompilerConfig.from_options({"dump_dir": "/d", "cache": False, "cache_dir": "/c", "verify": True,
                                     "strict": True, "target": "npu", "disabled_passes": ["canonicalize"],
                                     "quant": "dsa", "streams": 2, "superkernel": False}, env={})
    assert (c.debug.graph_dump.path, c.cache.enabled, c.cache.dir) == ("/d", False, "/c")
    assert (c.verify.enabled, c.strict, c.target, c.passes.disabled) == (True, True, "npu", ("canonicalize",))
    assert (c.quant.mode, c.streams.count, c.superkernel.enabled) == ("dsa", 2, False)


def test_required_flat_keys_exist():
    for key in ["dump_dir", "cache", "cache_dir", "verify", "strict", "target", "disabled_passes", "quant",
                "streams", "superkernel"]:
        assert key in FLAT_OPTIONS


def test_dotted_nested_keys_are_accepted():
    c = CompilerConfig.from_options({"debug.graph_dump.path": "/p", "experimental_config.frozen_parameter": True},
                                    env={})
    assert c.debug.graph_dump.path == "/p" and c.experimental_config.frozen_parameter


def test_unknown_option_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        CompilerConfig.from_options({"no_such_option": 1}, env={})
    message = str(info.value)
    assert "no_such_option" in message and "dump_dir" in message and "debug.graph_dump.path" in message


def test_unknown_attribute_raises():
    c = CompilerConfig()
    with pytest.raises(ConfigError, match="valid"):
        c.debug.graph_dump.folder = "x"


@pytest.mark.parametrize("options, word", [({"target": "gpu"}, "target"), ({"streams": 0}, "streams"),
                                           ({"quant": "int4"}, "quant"), ({"disabled_passes": ["nope"]}, "nope")])
def test_bad_values_are_rejected(options, word):
    with pytest.raises(ConfigError, match=word):
        CompilerConfig.from_options(options, env={})


def test_environment_overrides():
    env = {"ASCEND_DSA_DUMP_DIR": "/dump", "ASCEND_DSA_CACHE_DIR": "/cache", "ASCEND_DSA_DISABLE_CACHE": "1"}
    c = CompilerConfig.from_options({"cache": True}, env=env)
    assert c.debug.graph_dump.path == "/dump" and c.cache.dir == "/cache" and c.cache.enabled is False
    assert CompilerConfig.from_options({"dump_dir": "/mine"}, env=env).debug.graph_dump.path == "/mine"


def test_equal_configs_share_one_backend():
    a = get_backend({"streams": 2, "cache": False})
    b = get_backend(CompilerConfig.from_options({"cache": False, "streams": 2}))
    assert a is b and get_backend({"streams": 1, "cache": False}) is not a


def test_valid_names_cover_flat_and_nested():
    names = valid_option_names()
    assert "dump_dir" in names and "cache.max_size" in names


def test_torch_compile_mode_is_a_validated_setting():
    assert CompilerConfig().mode == "default"
    assert CompilerConfig.from_options(mode="reduce-overhead", env={}).mode == "reduce-overhead"
    assert CompilerConfig.from_options({"mode": "max-autotune"}, env={}).mode == "max-autotune"
    with pytest.raises(ConfigError, match=r"mode='no-such-mode'.*max-autotune"):
        CompilerConfig.from_options(mode="no-such-mode", env={})


def test_mode_is_part_of_the_key():
    assert CompilerConfig.from_options(mode="max-autotune", env={}).key() != CompilerConfig().key()


@pytest.mark.parametrize("mode, setting, compiler", [
    ("default", "auto", "python"), ("max-autotune", "auto", "measured"),
    ("max-autotune-no-cudagraphs", "auto", "measured"), ("reduce-overhead", "auto", "python"),
    ("max-autotune", "python", "python"), ("default", "inductor", "inductor")])
def test_superkernel_compiler_follows_the_mode_unless_set(mode, setting, compiler):
    config = CompilerConfig.from_options({"superkernel_compiler": setting}, mode=mode, env={})
    assert config.superkernel_compiler() == compiler


@pytest.mark.parametrize("options, words", [({"frozen_parameter": 1}, r"frozen_parameter.*True or False"),
                                            ({"cache_dir": 3}, r"cache\.dir.*string"),
                                            ({"streams": True}, r"streams\.count.*integer"),
                                            ({"verify_atol": "small"}, r"verify\.atol.*number")])
def test_values_of_the_wrong_type_are_rejected(options, words):
    with pytest.raises(ConfigError, match=words):
        CompilerConfig.from_options(options, env={})


def test_checked_copies_validates_and_applies_the_kill_switch():
    config = CompilerConfig()
    checked = config.checked(env={"ASCEND_DSA_DISABLE_CACHE": "1"})
    assert checked is not config and checked.cache.enabled is False and config.cache.enabled is True
    config.quant.mode = "int4"
    with pytest.raises(ConfigError, match=r"quant\.mode"):
        config.checked(env={})
