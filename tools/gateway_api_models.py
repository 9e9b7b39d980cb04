"""Typed models of the Gateway API objects deploy/ ships, for tools/validate-deploy: the Inference
Extension's InferencePool (inference.networking.k8s.io/v1) and Gateway API's HTTPRoute
(gateway.networking.k8s.io/v1).

No published Python model or offline CRD schema of these exists in the registries this project uses, so
these are kvferry's, written from the APIs' documented v1 fields. They are strict (an unknown field
fails) and cover every field of InferencePool's spec; of HTTPRoute, the fields a route to an
InferencePool uses (a route needing more fails here first: extend the model, from the API reference).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


PortNumber = Field(ge=1, le=65535)


class _Object(_Strict):
    apiVersion: str
    kind: str
    # ObjectMeta is Kubernetes' own; kubernetes-validate checks it on every core object already.
    metadata: dict[str, Any]


# ---- InferencePool -----------------------------------------------------------------------------------


class LabelSelector(_Strict):
    # Only matchLabels: the pool's selector is Service-like by design.
    matchLabels: dict[str, str] = Field(min_length=1)


class Port(_Strict):
    number: int = PortNumber


class EndpointPickerRef(_Strict):
    group: str = ""
    kind: str = "Service"
    name: str = Field(min_length=1, max_length=253)
    port: Port | None = None
    failureMode: Literal["FailOpen", "FailClose"] = "FailClose"


class InferencePoolSpec(_Strict):
    selector: LabelSelector
    targetPorts: list[Port] = Field(min_length=1, max_length=1)
    endpointPickerRef: EndpointPickerRef


class InferencePool(_Object):
    apiVersion: Literal["inference.networking.k8s.io/v1"]
    kind: Literal["InferencePool"]
    spec: InferencePoolSpec


# ---- HTTPRoute ---------------------------------------------------------------------------------------


class ParentReference(_Strict):
    group: str = "gateway.networking.k8s.io"
    kind: str = "Gateway"
    namespace: str | None = None
    name: str = Field(min_length=1)
    sectionName: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)


class PathMatch(_Strict):
    type: Literal["Exact", "PathPrefix", "RegularExpression"] = "PathPrefix"
    value: str = "/"


class HeaderMatch(_Strict):
    type: Literal["Exact", "RegularExpression"] = "Exact"
    name: str
    value: str


class RouteMatch(_Strict):
    path: PathMatch | None = None
    headers: list[HeaderMatch] | None = None
    method: Literal["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"] | None = (
        None
    )


class BackendRef(_Strict):
    group: str = ""
    kind: str = "Service"
    name: str = Field(min_length=1)
    namespace: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    weight: int | None = Field(default=None, ge=0, le=1000000)


class RouteTimeouts(_Strict):
    request: str | None = Field(default=None, pattern=r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
    backendRequest: str | None = Field(default=None, pattern=r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")


class RouteRule(_Strict):
    name: str | None = None
    matches: list[RouteMatch] | None = Field(default=None, max_length=64)
    backendRefs: list[BackendRef] | None = Field(default=None, max_length=16)
    timeouts: RouteTimeouts | None = None


class HTTPRouteSpec(_Strict):
    parentRefs: list[ParentReference] = Field(min_length=1, max_length=32)
    hostnames: list[str] | None = None
    rules: list[RouteRule] = Field(min_length=1, max_length=16)


class HTTPRoute(_Object):
    apiVersion: Literal["gateway.networking.k8s.io/v1"]
    kind: Literal["HTTPRoute"]
    spec: HTTPRouteSpec
