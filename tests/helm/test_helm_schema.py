"""values.schema.json rejects typos, wrong types and bad enums; the templates reject what the schema
cannot express; values.yaml documents every setting."""

from __future__ import annotations

import json
import re

import pytest

from helm_chart import CHART, HelmError, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize("item, message", [
    # typos, at several depths
    ('slos={"ttftMs":500}', "additional properties 'slos' not allowed"),
    ('prefill.autoscalling={"enabled":false}', "additional properties 'autoscalling' not allowed"),
    ('decode.autoscaling.behavior.scaleDown.stabilisationWindowSeconds=60', "stabilisationWindowSeconds"),
    ('router.apiKey.secret="x"', "additional properties 'secret' not allowed"),
    # wrong types
    ('slo.ttftMs="fast"', "got string, want integer"),
    ('prefill.gpus=1.5', "want integer"),
    ('networkPolicy.enabled="yes"', "got string, want boolean"),
    ('decode.autoscaling.targetKvCacheUsageRatio=1.5', "maximum"),
    ('decode.engine.gpuMemoryUtilization=1.5', "maximum"),
    ('prefill.engine.gpuMemoryUtilization=0', "exclusiveMinimum"),
    ('decode.engine.gpuMemoryUtilization="0.9"', "want null or number"),
    ('monitoring.prometheusAdapter.rateWindow="2 minutes"', "does not match pattern"),
    # bad enums
    ('kvTransport="rdma"', "value must be one of 'grpc', 'nccl'"),
    ('router.policy="random"', "value must be one of"),
    ('router.admission.mode="drop"', "value must be one of 'queue', 'reject'"),
    ('model.dtype="int8"', "value must be one of"),
    ('model.volume.type="nfs"', "value must be one of"),
    ('image.pullPolicy="Sometimes"', "value must be one of"),
    # option-specific requirements
    ('model.volume.type="pvc"', "claimName"),
    ('prefill.pdb={"enabled":true,"maxUnavailable":null,"minAvailable":null}', "anyOf"),
])
def test_schema_rejects(item, message):
    with pytest.raises(HelmError) as error:
        render(sets=(item,))
    assert "schema" in str(error.value) and message in str(error.value), str(error.value)


@pytest.mark.parametrize("items, message", [
    (('model.volume={"type":"pvc","pvc":{"claimName":"w"}}', 'model.name="/weights/llama"'), "must be \"/models\" or a path under it"),
    (("decode.engine.blockSize=32",), "blockSize must be equal"),
    (("prefill.autoscaling.minReplicas=5", "prefill.autoscaling.maxReplicas=2"), "must not exceed maxReplicas"),
    (("decode.autoscaling.targetRunningRequestsPerPod=null", "decode.autoscaling.targetKvCacheUsageRatio=null"),
     "needs targetRunningRequestsPerPod or targetKvCacheUsageRatio"),
])
def test_templates_reject_inconsistent_values(items, message):
    with pytest.raises(HelmError, match=re.escape(message)):
        render(sets=items)


def test_nulling_an_optional_key_falls_back_to_its_default():
    decode = render(sets=("decode.drainSeconds=null",)).get("Deployment", "cbserve-decode")
    assert "--drain-seconds=60" in decode["spec"]["template"]["spec"]["containers"][0]["args"]


def walk(node, path="#"):
    """Yield (path, schema) for every sub-schema."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, f"{path}/{index}")


@pytest.mark.no_helm
def test_schema_is_self_contained():
    for path, node in walk(SCHEMA):
        ref = node.get("$ref")
        if isinstance(ref, str):
            assert ref.startswith("#/definitions/"), (path, ref)
            assert ref.rsplit("/", 1)[1] in SCHEMA["definitions"], (path, ref)
        assert "$id" not in node, path


@pytest.mark.no_helm
def test_every_object_with_properties_rejects_unknown_keys():
    for path, node in walk(SCHEMA):
        if node.get("type") == "object" and "properties" in node and "/then/" not in path and "/anyOf/" not in path:
            assert node.get("additionalProperties") is False, path


@pytest.mark.no_helm
def test_every_top_level_value_is_commented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for index, line in enumerate(lines):
        if re.match(r"^[A-Za-z]\w*:", line):
            above = lines[index - 1] if index else ""
            assert above.startswith("#"), f"values.yaml: no comment above {line!r}"
    top_level = {m.group(1) for m in (re.match(r"^([A-Za-z]\w*):", l) for l in lines) if m}
    assert top_level == set(SCHEMA["properties"])
