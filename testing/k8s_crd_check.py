"""Custom resources checked against their CRDs (k8s/crds/) offline, as the API server checks them.

Run by tests/deploy/test_k8s_manifests.py with .venv-tools' python (jsonschema and cel-python, pinned in
k8s/tools-requirements.txt), never imported by the project's tests:

    python k8s_crd_check.py CRD_DIR < objects.json  ->  a JSON list: each object's errors

For each object: its CRD by group, version and kind (a served version); its defaults filled in
(the API server defaults before it validates); then the version's openAPIV3Schema with unknown
fields refused wherever the schema lists properties and does not preserve unknown fields (as
`kubectl apply --validate=strict` does); then every CEL rule (x-kubernetes-validations) on the
fields present, except transition rules (oldSelf: there is no old object); then metadata (names,
labels), which CRD schemas leave to the API server.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

Schema = dict[str, Any]
# Kubernetes' escaping of property names in CEL (k8s.io/apiserver/pkg/cel/escaping.go).
CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
                "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
CEL = celpy.Environment()


def load_crds(root: Path) -> dict[tuple[str, str, str], Schema]:
    """(group, version, kind) -> openAPIV3Schema, for every served version of every CRD under root."""
    out = {}
    for path in sorted(root.rglob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                out[spec["group"], version["name"], spec["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return out


def defaulted(schema: Schema, value: Any) -> Any:
    """``value`` with the schema's defaults filled in where a field is missing (recursively)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, item in value.items():
            sub = props.get(name, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                value[name] = defaulted(sub, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [defaulted(schema["items"], item) for item in value]
    return value


def strict(schema: Schema) -> Schema:
    """The schema with unknown fields refused where it lists its properties (not inside allOf/anyOf/
    oneOf/not, whose branches only add value checks in a structural schema)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    return out


def _escape(name: str) -> str:
    if name in CEL_RESERVED:
        return f"__{name}__"
    return name.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__").replace("/", "__slash__")


def _cel_value(schema: Schema, value: Any) -> Any:
    """``value`` as CEL sees it: properties under their escaped names, map keys as they are."""
    if isinstance(value, dict):
        if "properties" in schema:
            return {_escape(k): _cel_value(schema["properties"].get(k, {}), v) for k, v in value.items()}
        sub = schema.get("additionalProperties")
        return {k: _cel_value(sub if isinstance(sub, dict) else {}, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_value(schema.get("items", {}), v) for v in value]
    return value


def cel_errors(schema: Schema, value: Any, path: str = "") -> list[str]:
    """Every x-kubernetes-validations rule on ``value`` and below that does not hold."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: nothing to compare with on create
        try:
            program = CEL.program(CEL.compile(rule["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(_cel_value(schema, value))})
        except Exception as exc:  # noqa: BLE001  (celpy's own errors and a rule it cannot run alike)
            errors.append(f"{path or '.'}: rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if isinstance(result, celpy.CELEvalError):  # (celpy returns some errors as values)
            errors.append(f"{path or '.'}: rule {rule['rule']!r} could not be evaluated: {result}")
        elif not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            errors.append(f"{path or '.'}: {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for name, item in value.items():
            sub = schema.get("properties", {}).get(name, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                errors += cel_errors(sub, item, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def metadata_errors(meta: dict) -> list[str]:
    errors = [f"metadata.{k}: not expected in a manifest" for k in meta
              if k not in ("name", "namespace", "labels", "annotations")]
    name = meta.get("name", "")
    if not (len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name)):
        errors.append(f"metadata.name: {name!r} is not a DNS subdomain")
    if "namespace" in meta and not (len(meta["namespace"]) <= 63 and DNS_LABEL.fullmatch(meta["namespace"])):
        errors.append(f"metadata.namespace: {meta['namespace']!r} is not a DNS label")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (prefix and not DNS_SUBDOMAIN.fullmatch(prefix)) or not (len(label) <= 63 and LABEL_NAME.fullmatch(label)):
            errors.append(f"metadata.labels: {key!r} is not a label name")
        if not (isinstance(value, str) and len(value) <= 63 and LABEL_VALUE.fullmatch(value)):
            errors.append(f"metadata.labels[{key}]: {value!r} is not a label value")
    return errors


def check(obj: dict, crds: dict[tuple[str, str, str], Schema]) -> list[str]:
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    schema = crds.get((group, version, obj.get("kind")))
    if schema is None:
        return [f"no served CRD version for {obj.get('apiVersion')} {obj.get('kind')}"]
    obj = defaulted(schema, copy.deepcopy(obj))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
              for e in jsonschema.Draft4Validator(strict(schema)).iter_errors(obj)]
    return errors + cel_errors(schema, obj) + metadata_errors(obj.get("metadata") or {})


def main() -> None:
    crds = load_crds(Path(sys.argv[1]))
    json.dump([check(obj, crds) for obj in json.load(sys.stdin)], sys.stdout)


if __name__ == "__main__":
    main()
