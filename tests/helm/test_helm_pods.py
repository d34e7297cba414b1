"""Pod specs: command lines match the CLI contract, probes fit model load and draining, the grace
period is derived from the drain window, GPUs, /dev/shm and the model volume options."""

from __future__ import annotations

import math

import pytest
import yaml

from helm_chart import CHART, VALUES_SETS, HelmError, container, flags, name, render

# Flags of the CLI contract plus the pods' argparse and RouterConfig fields (cbserve/cli.py,
# router/config.py); the chart may pass nothing else.
POOL_FLAGS = {"model", "host", "port", "metrics-port", "device", "dtype", "quantization", "kv-cache-dtype",
              "kv-transport", "kv-store-port",
              "kv-ttl-seconds", "drain-seconds", "max-num-batched-tokens", "max-num-seqs", "block-size",
              "num-blocks", "kv-cache-memory-mb", "gpu-memory-utilization", "enforce-eager", "pod-id",
              "tensor-parallel-size", "cluster-secret-file", "tls-cert", "tls-key", "tls-ca",
              "tls-server-name", "health-port", "enable-lora", "max-loras", "max-cpu-loras", "max-lora-rank",
              "lora-modules", "allow-runtime-lora-updating", "lora-root"}
DECODE_ONLY_FLAGS = {"no-local-prefill-fallback", "colocated", "speculative-config"}
ROUTER_FLAGS = {"model", "served-model-name", "host", "port", "discovery", "namespace", "prefill-service",
                "decode-service", "colocated-service", "kv-transport", "grpc-port-name", "policy", "slo-ttft-ms", "slo-tpot-ms", "admission", "max-queue-seconds", "startup-wait-seconds",
                "api-key-env", "drain-seconds", "cluster-secret-file", "tls-cert", "tls-key", "tls-ca",
                "tls-server-name", "max-request-body-bytes", "tool-call-parser", "enable-auto-tool-choice",
                "max-tools", "max-schema-bytes", "max-schema-depth", "reasoning-parser", "enable-lora",
                "allow-runtime-lora-updating"}
GRPC_SERVICE = {"prefill": "cbserve.v1.PrefillService", "decode": "cbserve.v1.DecodeService"}
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def merged_values(values_files: tuple[str, ...]) -> dict:
    """Chart defaults overlaid with the values files (enough merging for the keys used here)."""
    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        return out
    values = DEFAULTS
    for path in values_files:
        values = merge(values, yaml.safe_load(open(path)))
    return values


def deployments(manifests) -> dict[str, dict]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in manifests.of_kind("Deployment")}


@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_args_are_contract_flags(values_set):
    for component, deployment in deployments(render(VALUES_SETS[values_set])).items():
        main = container(deployment)
        assert "command" not in main, "the image's entrypoint runs cbserve"
        assert main["args"][0] == component
        allowed = ROUTER_FLAGS if component == "router" else POOL_FLAGS | (DECODE_ONLY_FLAGS if component == "decode" else set())
        assert set(flags(main["args"])) <= allowed, set(flags(main["args"])) - allowed


def test_pool_args_and_ports_carry_the_values():
    manifests = render()
    for pool in ("prefill", "decode"):
        main = container(manifests.get("Deployment", name(pool)))
        args = flags(main["args"])
        assert (args["port"], args["metrics-port"], args["kv-store-port"]) == ("50051", "9400", "50061")
        assert (args["model"], args["device"], args["kv-transport"], args["pod-id"]) == ("tiny", "cuda", "grpc", "$(POD_NAME)")
        assert {p["name"]: p["containerPort"] for p in main["ports"]} == {"grpc": 50051, "metrics": 9400}
        env = {e["name"]: e for e in main["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # decode_pod/server.py advertises this address for its TCPStore (nccl transport).
        assert env["CBSERVE_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    router = flags(container(manifests.get("Deployment", name("router")))["args"])
    assert (router["slo-ttft-ms"], router["slo-tpot-ms"], router["policy"], router["admission"]) == ("500", "50", "goodput", "queue")


def test_quantization_reaches_both_pools_only_when_set():
    assert all("quantization" not in flags(container(d)["args"]) for d in deployments(render()).values())
    quantized = deployments(render(sets=('model.quantization="int8"',)))
    assert [flags(container(quantized[pool])["args"])["quantization"] for pool in ("prefill", "decode")] == ["int8"] * 2
    assert all("kv-cache-dtype" not in flags(container(d)["args"]) for d in deployments(render()).values())
    fp8 = deployments(render(sets=('model.quantization="fp8"', 'model.kvCacheDtype="fp8"')))
    for pool in ("prefill", "decode"):
        args = flags(container(fp8[pool])["args"])
        assert (args["quantization"], args["kv-cache-dtype"]) == ("fp8", "fp8")


def test_api_key_comes_from_the_secret_reference():
    assert "api-key-env" not in flags(container(render().get("Deployment", name("router")))["args"])
    main = container(render(VALUES_SETS["gpu-llama3-8b"]).get("Deployment", name("router")))
    assert flags(main["args"])["api-key-env"] == "CBSERVE_API_KEY"
    (env,) = [e for e in main["env"] if e["name"] == "CBSERVE_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "cbserve-api-key", "key": "api-key"}


@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_grace_period_and_prestop_derive_from_the_drain_window(values_set):
    values = merged_values(VALUES_SETS[values_set])
    drain = values["drain"]
    for component, deployment in deployments(render(VALUES_SETS[values_set])).items():
        pod = deployment["spec"]["template"]["spec"]
        main = container(deployment)
        drain_seconds = int(flags(main["args"])["drain-seconds"])
        override = values[component].get("drainSeconds")
        assert drain_seconds == (override if override is not None else drain["seconds"])
        assert main["lifecycle"]["preStop"] == {"sleep": {"seconds": drain["preStopSeconds"]}}
        assert pod["terminationGracePeriodSeconds"] == drain["preStopSeconds"] + drain_seconds + drain["killMarginSeconds"]
        assert pod["terminationGracePeriodSeconds"] > drain["preStopSeconds"] + drain_seconds


def test_prestop_uses_exec_sleep_before_kubernetes_1_30():
    main = container(render(kube_version="1.29.0").get("Deployment", name("decode")))
    assert main["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}


@pytest.mark.parametrize("values_set", sorted(VALUES_SETS))
def test_probes_fit_model_load_readiness_and_drain(values_set):
    values = merged_values(VALUES_SETS[values_set])
    for component, deployment in deployments(render(VALUES_SETS[values_set])).items():
        if component == "router":
            continue
        main = container(deployment)
        startup, readiness, liveness = main["startupProbe"], main["readinessProbe"], main["livenessProbe"]
        # Startup: gRPC health, long enough for the configured model load.
        assert startup["grpc"] == {"port": 50051, "service": GRPC_SERVICE[component]}
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert values["model"]["loadTimeoutSeconds"] <= budget < values["model"]["loadTimeoutSeconds"] + startup["periodSeconds"]
        # Readiness: the health service, which turns NOT_SERVING at SIGTERM.
        assert readiness["grpc"] == {"port": 50051, "service": GRPC_SERVICE[component]}
        # Liveness: never gRPC health (NOT_SERVING while draining would restart a draining pod),
        # and patient enough for a kernel compilation to hold the CPU for a minute.
        assert "grpc" not in liveness and liveness["httpGet"] == {"path": "/metrics", "port": "metrics"}
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
        assert liveness["timeoutSeconds"] >= 5


def test_router_probes_use_health_and_ready():
    main = container(render().get("Deployment", name("router")))
    assert main["livenessProbe"]["httpGet"]["path"] == "/health"
    assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert main["startupProbe"]["httpGet"]["path"] == "/health"


def test_router_startup_wait_carries_the_value():
    # A request that finds the pools still starting (or a rolling update's replacements) waits.
    assert flags(container(render().get("Deployment", name("router")))["args"])["startup-wait-seconds"] == "60"
    main = container(render(sets=("router.startupWaitSeconds=0",)).get("Deployment", name("router")))
    assert flags(main["args"])["startup-wait-seconds"] == "0"
    with pytest.raises(HelmError, match="startupWaitSeconds"):
        render(sets=("router.startupWaitSeconds=-1",))


def test_gpus_shm_and_device():
    manifests = render()
    for pool in ("prefill", "decode"):
        deployment = manifests.get("Deployment", name(pool))
        main = container(deployment)
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert main["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert flags(main["args"])["device"] == "cuda"
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    cpu = container(render(VALUES_SETS["cpu-tiny"]).get("Deployment", name("decode")))
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert flags(cpu["args"])["device"] == "cpu"


def test_tiny_model_needs_no_volume_and_writes_only_to_emptydirs():
    deployment = render().get("Deployment", name("prefill"))
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    # Besides the deployment secret (read-only, test_helm_trust.py), only scratch emptyDirs.
    scratch = [v for v in pod["volumes"] if v["name"] != "cluster-secret"]
    assert {v["name"] for v in scratch} == {"dshm", "cache", "tmp"}
    assert all("emptyDir" in v for v in scratch)
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert {"name": "cache", "mountPath": env["CBSERVE_CACHE_DIR"]} in main["volumeMounts"]


def test_model_volume_pvc():
    manifests = render(sets=('model.volume={"type":"pvc","pvc":{"claimName":"weights","subPath":"m"}}',
                             'model.name="/models/llama"'))
    for component in ("router", "prefill", "decode"):
        deployment = manifests.get("Deployment", name(component))
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        assert {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "m"} in container(deployment)["volumeMounts"]


def test_model_volume_host_path():
    manifests = render(VALUES_SETS["gpu-hostpath-qwen2-7b"])
    pod = manifests.get("Deployment", name("decode"))["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["hostPath"] == {"path": "/var/lib/llm-weights", "type": "Directory"}
    assert flags(container(manifests.get("Deployment", name("decode")))["args"])["model"] == "/models/Qwen2-7B-Instruct"


def test_model_volume_copy_from_pvc_uses_an_init_copy_onto_local_disk():
    manifests = render(VALUES_SETS["gpu-llama3-8b"])
    for pool in ("prefill", "decode"):
        pod = manifests.get("Deployment", name(pool))["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-source"]["persistentVolumeClaim"] == {"claimName": "llm-weights", "readOnly": True}
        assert volumes["model"]["emptyDir"] == {"sizeLimit": "40Gi"}
        (init,) = pod["initContainers"]
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert mounts["model-source"]["readOnly"] is True and mounts["model"]["mountPath"] == "/models"
        assert "cp -R" in init["command"][-1]
    router_pod = manifests.get("Deployment", name("router"))["spec"]["template"]["spec"]
    assert "initContainers" not in router_pod, "the router reads tokenizer files from the claim directly"
    (router_model,) = [v for v in router_pod["volumes"] if v["name"] == "model"]
    assert router_model["persistentVolumeClaim"]["claimName"] == "llm-weights"


def test_startup_threshold_is_ceiling_of_load_time_over_period():
    main = container(render(sets=("model.loadTimeoutSeconds=95",)).get("Deployment", name("decode")))
    assert main["startupProbe"]["failureThreshold"] == math.ceil(95 / 10)


def test_colocated_decode_pods_and_router_discovery():
    manifests = render(VALUES_SETS["colocated-minimal"])
    decode = flags(container(manifests.get("Deployment", name("decode")))["args"])
    assert decode["colocated"] is True and "no-local-prefill-fallback" not in decode
    router = flags(container(manifests.get("Deployment", name("router")))["args"])
    assert router["colocated-service"] == name("decode")
    assert not {"prefill-service", "decode-service", "kv-transport"} & set(router)
    disaggregated = render(sets=("decode.disableLocalPrefillFallback=true",))
    decode = flags(container(disaggregated.get("Deployment", name("decode")))["args"])
    assert decode["no-local-prefill-fallback"] is True and "colocated" not in decode


def test_engine_sizing_and_served_name_flags():
    manifests = render(VALUES_SETS["gpu-llama3-8b"])
    prefill = flags(container(manifests.get("Deployment", name("prefill")))["args"])
    assert prefill["kv-cache-memory-mb"] == "16384" and "gpu-memory-utilization" not in prefill
    decode = flags(container(manifests.get("Deployment", name("decode")))["args"])
    assert decode["gpu-memory-utilization"] == "0.9" and "kv-cache-memory-mb" not in decode
    router = flags(container(manifests.get("Deployment", name("router")))["args"])
    assert router["served-model-name"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert router["kv-transport"] == "nccl"
    default = flags(container(render().get("Deployment", name("decode")))["args"])
    assert "kv-cache-memory-mb" not in default and "num-blocks" not in default


def pool_sizing_flags(sets: tuple[str, ...] = (), values_files: tuple[str, ...] = ()) -> dict[str, dict]:
    """{pool: its KV sizing flags} of one rendering."""
    manifests = render(values_files, sets)
    sizing = ("device", "num-blocks", "kv-cache-memory-mb", "gpu-memory-utilization")
    out = {}
    for pool in ("prefill", "decode"):
        args = flags(container(manifests.get("Deployment", name(pool)))["args"])
        out[pool] = {key: args[key] for key in sizing if key in args}
    return out


@pytest.mark.parametrize("sets, expected", [
    # GPU pools without an explicit size: the KV cache comes from device memory, 0.9 by default.
    ((), {"prefill": {"device": "cuda", "gpu-memory-utilization": "0.9"},
          "decode": {"device": "cuda", "gpu-memory-utilization": "0.9"}}),
    (("decode.engine.gpuMemoryUtilization=0.45",),
     {"prefill": {"device": "cuda", "gpu-memory-utilization": "0.9"},
      "decode": {"device": "cuda", "gpu-memory-utilization": "0.45"}}),
    # An explicit size wins; the engine still gets the fraction only when it was set.
    (("prefill.engine.numBlocks=4096", "decode.engine.kvCacheMemoryMb=20480"),
     {"prefill": {"device": "cuda", "num-blocks": "4096"},
      "decode": {"device": "cuda", "kv-cache-memory-mb": "20480"}}),
    (("decode.engine.kvCacheMemoryMb=20480", "decode.engine.gpuMemoryUtilization=0.5"),
     {"prefill": {"device": "cuda", "gpu-memory-utilization": "0.9"},
      "decode": {"device": "cuda", "kv-cache-memory-mb": "20480", "gpu-memory-utilization": "0.5"}}),
    # CPU pools render nothing new, even with the fraction set (the command keeps its 256 MiB).
    (("prefill.gpus=0", "decode.gpus=0", "decode.engine.gpuMemoryUtilization=0.5"),
     {"prefill": {"device": "cpu"}, "decode": {"device": "cpu"}}),
])
def test_gpu_pools_size_the_kv_cache_from_device_memory(sets, expected):
    assert pool_sizing_flags(sets) == expected


def test_cpu_examples_keep_their_block_counts():
    for pool, sizing in pool_sizing_flags(values_files=VALUES_SETS["cpu-tiny"]).items():
        assert sizing == {"device": "cpu", "num-blocks": "256"}, pool


def test_enforce_eager_is_per_pool_and_off_by_default():
    manifests = render((), ("decode.engine.enforceEager=true",))
    decode = container(manifests.get("Deployment", name("decode")))["args"]
    prefill = container(manifests.get("Deployment", name("prefill")))["args"]
    assert "--enforce-eager" in decode and "--enforce-eager" not in prefill
    assert "--enforce-eager" not in container(render().get("Deployment", name("decode")))["args"]


def test_speculative_config_reaches_the_decode_pool_as_json_and_the_prefill_pool_when_given():
    assert all("speculative-config" not in flags(container(d)["args"]) for d in deployments(render()).values())
    pools = deployments(render(sets=('decode.engine.speculativeConfig={"method":"ngram","num_speculative_tokens":4,'
                                     '"prompt_lookup_max":5}',)))
    assert "speculative-config" not in flags(container(pools["prefill"])["args"])
    # A speculating decode pool runs one KV group: its prefill pool must too (the handshake compares them).
    assert flags(container(pools["prefill"])["args"])["kv-cache-groups"] == "single"
    assert all("kv-cache-groups" not in flags(container(d)["args"]) for d in deployments(render()).values())
    from engine.spec_decode.config import SpeculativeConfig
    value = flags(container(pools["decode"])["args"])["speculative-config"]
    assert SpeculativeConfig.from_json(value) == SpeculativeConfig("ngram", 4, 5, 5)
    with pytest.raises(HelmError, match="speculativeConfig"):
        render(sets=('decode.engine.speculativeConfig={"method":"eagle3","num_speculative_tokens":4}',))
    # The prefill pool ships a draft's KV only when given the draft (opt-in).
    draft = '{"method":"draft_model","model":"/models/draft","num_speculative_tokens":4}'
    pools = deployments(render(sets=(f"decode.engine.speculativeConfig={draft}",)))
    assert "speculative-config" not in flags(container(pools["prefill"])["args"])
    pools = deployments(render(sets=(f"decode.engine.speculativeConfig={draft}",
                                     f"prefill.engine.speculativeConfig={draft}")))
    for pool in ("prefill", "decode"):
        value = flags(container(pools[pool])["args"])["speculative-config"]
        assert SpeculativeConfig.from_json(value) == SpeculativeConfig("draft_model", 4, model="/models/draft")


def test_tensor_parallel_size_is_per_pool_with_one_gpu_per_rank():
    manifests = render((), ("prefill.engine.tensorParallelSize=2", "decode.engine.tensorParallelSize=4"))
    for pool, size in (("prefill", 2), ("decode", 4)):
        main = container(manifests.get("Deployment", name(pool)))
        assert flags(main["args"])["tensor-parallel-size"] == str(size)
        assert main["resources"]["limits"]["nvidia.com/gpu"] == size
        assert main["resources"]["requests"]["nvidia.com/gpu"] == size
    assert "tensor-parallel-size" not in flags(container(render().get("Deployment", name("decode")))["args"])
    cpu = container(render(VALUES_SETS["cpu-tiny"], ("decode.engine.tensorParallelSize=2",))
                    .get("Deployment", name("decode")))
    assert flags(cpu["args"])["tensor-parallel-size"] == "2"
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})


def test_tensor_parallel_pools_need_the_grpc_kv_transport():
    with pytest.raises(HelmError, match="tensorParallelSize=2 needs kvTransport=grpc"):
        render((), ("decode.engine.tensorParallelSize=2", 'kvTransport="nccl"'))


def test_router_tool_and_reasoning_values_become_flags():
    default = container(render().get("Deployment", name("router")))["args"]
    assert not any(a.startswith(("--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser"))
                   for a in default)
    assert "--max-tools=128" in default and "--max-schema-bytes=65536" in default
    args = container(render(sets=('router.tools.callParser="hermes"', "router.tools.enableAutoToolChoice=true",
                                  'router.reasoningParser="qwen3"')).get("Deployment", name("router")))["args"]
    assert {"--tool-call-parser=hermes", "--enable-auto-tool-choice", "--reasoning-parser=qwen3"} <= set(args)
    with pytest.raises(HelmError, match="callParser"):
        render(sets=("router.tools.enableAutoToolChoice=true",))
    with pytest.raises(HelmError):
        render(sets=('router.tools.callParser="pythonic"',))

