"""Validate manifests against the real published schemas, as strictly as `kubectl --validate=strict` would.

- core kinds (ConfigMap, Service, NetworkPolicy, Job, and every embedded PodTemplateSpec): the Kubernetes
  OpenAPI schemas shipped by `kubernetes-validate` (strict variants: unknown fields are errors);
- PyTorchJob: the Kubeflow Training SDK's models (`kubeflow-training`), pod templates through the `kubernetes`
  client models they reference and the Kubernetes schema above;
- TrainJob: the Kubeflow Trainer API models (`kubeflow-trainer-api`, pydantic);
- RayJob: KubeRay's own CRD (openAPIV3Schema), vendored here (see SOURCE.md: no package carries it).
The generated models ignore unknown keys, so `_walk_*` rejects any key the model does not declare first.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import typing
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

HERE = Path(__file__).resolve().parent
KUBERNETES_VERSION = "1.33.0"  # the oldest release still supported upstream when this was written


class SchemaError(AssertionError):
    pass


# ------------------------------------------------------------------------------------ Kubernetes core

def validate_core(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise SchemaError(f"{doc['kind']}: {e.message} at {list(e.path)}") from None


@functools.cache
def _kubernetes_schema(name: str) -> jsonschema.Validator:
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{KUBERNETES_VERSION}-local-strict"
    schema = json.loads((folder / name).read_text())
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = Registry().with_resource("_definitions.json", Resource(contents=definitions, specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


def validate_pod_template(template: dict[str, Any]) -> None:
    errors = sorted(_kubernetes_schema("podtemplatespec-v1.json").iter_errors(template), key=lambda e: list(e.path))
    if errors:
        raise SchemaError(f"PodTemplateSpec: {errors[0].message} at {list(errors[0].path)}")


# ------------------------------------------------------------------------------------ KubeRay (CRD)

@functools.cache
def rayjob_schema() -> dict[str, Any]:
    crd = yaml.safe_load(gzip.decompress((HERE / "ray.io_rayjobs.yaml.gz").read_bytes()))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def validate_crd_object(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    _walk_openapi(doc, schema, "")
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        raise SchemaError(f"{doc.get('kind')}: {errors[0].message} at {list(errors[0].path)}")


def _walk_openapi(value: Any, schema: dict[str, Any], where: str) -> None:
    """Unknown fields are errors, as with the API server's strict field validation."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                for k, v in value.items():
                    _walk_openapi(v, extra, f"{where}.{k}")
            return
        for k, v in value.items():
            if where == "" and k in ("apiVersion", "kind", "metadata"):
                continue
            if k not in props:
                raise SchemaError(f"unknown field {where}.{k}".replace("field .", "field "))
            _walk_openapi(v, props[k], f"{where}.{k}")
    elif isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            _walk_openapi(v, schema["items"], f"{where}[{i}]")


def validate_rayjob(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    validate_crd_object(doc, rayjob_schema())
    cluster = doc["spec"]["rayClusterSpec"]
    for template in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        validate_pod_template(template)


# ------------------------------------------------------------------------------------ Kubeflow Training (PyTorchJob)

def _openapi_model(name: str) -> type:
    import kubeflow.training.models as kf_models
    import kubernetes.client.models as k8s_models

    for module in (kf_models, k8s_models):
        if hasattr(module, name):
            return getattr(module, name)
    raise SchemaError(f"no model {name}")


_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def _walk_openapi_model(value: Any, type_name: str, where: str) -> Any:
    """Build the SDK model from `value`, rejecting keys the model does not declare; returns the model."""
    if type_name in _PRIMITIVES:
        if not isinstance(value, _PRIMITIVES[type_name]) or (type_name == "int" and isinstance(value, bool)):
            raise SchemaError(f"{where}: expected {type_name}, got {value!r}")
        return value
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list")
        return [_walk_openapi_model(v, m.group(1), f"{where}[{i}]") for i, v in enumerate(value)]
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a mapping")
        return {k: _walk_openapi_model(v, m.group(1), f"{where}.{k}") for k, v in value.items()}
    cls = _openapi_model(type_name)
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected a {type_name} mapping")
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    kwargs = {}
    for k, v in value.items():
        if k not in by_json:
            raise SchemaError(f"unknown field {where}.{k} ({type_name})".replace("field .", "field "))
        attr = by_json[k]
        kwargs[attr] = _walk_openapi_model(v, cls.openapi_types[attr], f"{where}.{k}")
    try:
        return cls(**kwargs)  # the generated constructors check required fields and enums
    except ValueError as e:
        raise SchemaError(f"{where or type_name}: {e}") from None


def validate_pytorchjob(doc: dict[str, Any]) -> Any:
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    model = _walk_openapi_model(doc, "KubeflowOrgV1PyTorchJob", "")
    for replica in doc["spec"]["pytorchReplicaSpecs"].values():
        validate_pod_template(replica["template"])
    return model


# ------------------------------------------------------------------------------------ Kubeflow Trainer v2 (TrainJob)

def _walk_pydantic(value: Any, annotation: Any, where: str) -> None:
    import pydantic

    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return _walk_pydantic(value, options[0], where)
        return None
    if origin in (list, list):
        for i, v in enumerate(value):
            _walk_pydantic(v, typing.get_args(annotation)[0], f"{where}[{i}]")
        return None
    if origin in (dict, dict):
        for k, v in value.items():
            _walk_pydantic(v, typing.get_args(annotation)[1], f"{where}.{k}")
        return None
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        if "actual_instance" in annotation.model_fields:  # a oneOf wrapper (e.g. a Quantity: number or string)
            try:
                annotation.from_json(json.dumps(value))
            except (ValueError, pydantic.ValidationError) as e:
                raise SchemaError(f"{where}: {e}") from None
            return None
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a {annotation.__name__} mapping")
        fields = {(f.alias or name): f for name, f in annotation.model_fields.items()}
        for k, v in value.items():
            if k not in fields:
                raise SchemaError(f"unknown field {where}.{k} ({annotation.__name__})".replace("field .", "field "))
            _walk_pydantic(v, fields[k].annotation, f"{where}.{k}")
    return None


def validate_trainjob(doc: dict[str, Any]) -> Any:
    from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import (
        TrainerV1alpha1TrainJob,
    )

    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and doc["kind"] == "TrainJob"
    _walk_pydantic(doc, TrainerV1alpha1TrainJob, "")
    import pydantic

    try:
        return TrainerV1alpha1TrainJob.from_dict(doc)
    except pydantic.ValidationError as e:
        raise SchemaError(f"TrainJob: {e}") from None


# ------------------------------------------------------------------------------------ dispatch

def validate_manifest(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind == "RayJob":
        validate_rayjob(doc)
    elif kind == "PyTorchJob":
        validate_pytorchjob(doc)
    elif kind == "TrainJob":
        validate_trainjob(doc)
    else:
        validate_core(doc)
