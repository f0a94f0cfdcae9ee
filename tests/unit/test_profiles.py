from pathlib import Path

import pytest

from serve_app.profiles import (
    EngineArgs,
    EngineProfile,
    Platform,
    ProfileError,
    load_profile,
    profiles_dir,
)

SHIPPED = sorted(profiles_dir().glob("*.yaml"))


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


BASE = """
model: builtin:ernie-4.5-tiny
engine:
  max_model_len: 2048
  kv_cache_memory_bytes: 268435456
"""


def test_shipped_profiles_exist() -> None:
    assert {p.stem for p in SHIPPED} >= {"low-latency", "throughput"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("platform", list(Platform))
def test_shipped_profiles_resolve_on_every_platform(path: Path, platform: Platform) -> None:
    resolved = load_profile(path).resolve(platform)
    assert resolved.max_model_len >= 1024
    block = resolved.engine.block_size
    assert block is None or block % (32 if platform is Platform.CPU else 16) == 0


def test_cpu_override_replaces_model_and_block(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "p",
        """
model: builtin:ernie-4.5-0.3b
engine: {block_size: 16, max_model_len: 2048, gpu_memory_utilization: 0.5}
platforms:
  cpu:
    model: builtin:ernie-4.5-tiny
    engine: {block_size: 32, kv_cache_memory_bytes: 268435456}
""",
    )
    profile = load_profile(path)
    cpu = profile.resolve(Platform.CPU)
    cuda = profile.resolve(Platform.CUDA)
    assert (cpu.model, cpu.engine.block_size) == ("builtin:ernie-4.5-tiny", 32)
    assert (cuda.model, cuda.engine.block_size) == ("builtin:ernie-4.5-0.3b", 16)
    # values the override does not set are kept
    assert cpu.engine.gpu_memory_utilization == 0.5
    assert cpu.engine.max_model_len == 2048


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, "p", BASE + "  max_num_seq: 4\n")
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value)
    assert "engine.max_num_seq: unknown key" in str(err.value)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "p", BASE + "replicas: 3\n")
    with pytest.raises(ProfileError, match=r"replicas: unknown key"):
        load_profile(path)


def test_enable_paged_attn_explains_that_paged_kv_is_always_on(tmp_path: Path) -> None:
    path = write(tmp_path, "p", BASE + "  enable_paged_attn: false\n")
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert str(path) in message
    assert "enable_paged_attn" in message
    assert "always on" in message


@pytest.mark.parametrize(
    ("platform", "allowed"),
    [(Platform.CUDA, "multiple of 16 (16, 32, 64, 128)"), (Platform.CPU, "multiple of 32")],
)
def test_block_size_8_is_refused_with_allowed_sizes(platform: Platform, allowed: str) -> None:
    profile = EngineProfile(
        name="p",
        model="m",
        engine=EngineArgs(block_size=8, max_model_len=2048, kv_cache_memory_bytes=1 << 28),
    )
    with pytest.raises(ProfileError) as err:
        profile.resolve(platform)
    assert "block_size 8 is not supported" in str(err.value)
    assert allowed in str(err.value)
    assert f"platforms.{platform.value}.engine.block_size" in str(err.value)


def test_block_16_is_cuda_only() -> None:
    profile = EngineProfile(
        name="p",
        model="m",
        engine=EngineArgs(block_size=16, max_model_len=2048, kv_cache_memory_bytes=1 << 28),
    )
    assert profile.resolve(Platform.CUDA).engine.block_size == 16
    with pytest.raises(ProfileError, match="multiple of 32"):
        profile.resolve(Platform.CPU)


def test_cpu_needs_an_explicit_kv_cache_size() -> None:
    profile = EngineProfile(name="p", model="m", engine=EngineArgs(max_model_len=2048))
    with pytest.raises(ProfileError, match="kv_cache_memory_bytes"):
        profile.resolve(Platform.CPU)
    assert profile.resolve(Platform.CUDA).max_model_len == 2048


def test_max_model_len_is_required() -> None:
    profile = EngineProfile(name="p", model="m", engine=EngineArgs())
    with pytest.raises(ProfileError, match="max_model_len must be set"):
        profile.resolve(Platform.CUDA)


def test_replica_bounds_ordered(tmp_path: Path) -> None:
    path = write(tmp_path, "p", BASE + "pool: {min_replicas: 3, max_replicas: 2}\n")
    with pytest.raises(ProfileError, match=r"min_replicas \(3\) exceeds max_replicas \(2\)"):
        load_profile(path)


def test_name_must_match_file(tmp_path: Path) -> None:
    path = write(tmp_path, "fast", BASE + "name: slow\n")
    with pytest.raises(ProfileError, match="must match the file name"):
        load_profile(path)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(write(tmp_path, "p", "engine: [unclosed\n"))
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "absent.yaml")


def test_engine_kwargs_use_vllm_names() -> None:
    args = EngineArgs(block_size=32, max_model_len=1024, enable_prefix_caching=True)
    assert args.to_vllm_kwargs() == {
        "block_size": 32,
        "max_model_len": 1024,
        "enable_prefix_caching": True,
    }
