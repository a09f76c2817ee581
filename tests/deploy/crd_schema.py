"""A CustomResourceDefinition's openAPIV3Schema as a JSON Schema validator that also rejects unknown fields.

The API server prunes fields a structural schema does not declare, silently: a misspelled
`nodeselector` would vanish from the RayCluster with no error. So every object schema that declares
properties and does not preserve unknown fields gets `additionalProperties: false` here, making such
a typo a validation error. The `x-kubernetes-*` extensions themselves are API-server behaviour
(list merge keys, CEL rules on updates) with nothing to check in one rendered manifest; int-or-string
fields already carry `anyOf: [integer, string]` and the int32/int64 formats are not asserted.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _strict(schema: dict) -> dict:
    out = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-"):
            continue
        if key in ("properties", "patternProperties"):
            value = {name: _strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            value = _strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            value = [_strict(sub) for sub in value]
        out[key] = value
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(crd_path: Path, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.load(crd_path.read_text(), Loader=_LOADER)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    # apiVersion, kind and metadata are the API server's to check; the CRD leaves them open.
    schema["properties"].update({"apiVersion": {"const": f"{crd['spec']['group']}/{version}"},
                                 "kind": {"const": crd["spec"]["names"]["kind"]}})
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(validator: jsonschema.Draft7Validator, manifest: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in validator.iter_errors(manifest)]
