from serve_app.bench import servers
from serve_app.profiles import EngineArgs, EngineProfile, Platform


def test_vllm_serve_flags_carry_every_engine_argument() -> None:
    profile = EngineProfile(
        name="p",
        model="m",
        engine=EngineArgs(
            max_model_len=2048,
            block_size=32,
            enforce_eager=True,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=1 << 28,
        ),
    ).resolve(Platform.CPU)
    flags = servers.vllm_serve_flags(profile)
    assert flags[flags.index("--max-model-len") + 1] == "2048"
    assert flags[flags.index("--block-size") + 1] == "32"
    assert "--enforce-eager" in flags and "--no-enable-prefix-caching" in flags
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)
