"""Who a request is (http_keys.py), without a server: a tenant from x-api-key or its Bearer token alike, the
operator's admin key read the same way, and who may read /metrics (MetricsReaders) in each configuration."""

import pytest
from starlette.datastructures import Headers

from prefixserve.http import APIError
from prefixserve.http_keys import AdminKey, KeyTable, MetricsReaders, credentials_of
from prefixserve.router.settings import RouterSettings
from prefixserve.server.api import ServerSettings
from prefixserve.server.auth import Authenticator

TENANTS = KeyTable({"key-a": "tenant-a"})


def credentials(**headers):
    return credentials_of(Headers(headers=headers))


def test_a_tenant_is_that_of_its_key_in_either_header():
    assert TENANTS.tenant_of(credentials(authorization="Bearer key-a")) == "tenant-a"
    assert TENANTS.tenant_of(credentials(**{"x-api-key": "key-a"})) == "tenant-a"
    assert TENANTS.tenant_of(credentials(**{"x-api-key": "key-a", "authorization": "Bearer key-a"})) == "tenant-a"
    assert TENANTS.tenant_of(credentials()) is None
    assert TENANTS.tenant_of(credentials(authorization="Basic key-a")) is None
    assert KeyTable({}).tenant_of(credentials(authorization="Bearer key-a")) is None


def test_the_admin_key_is_read_from_either_header():
    admin = AdminKey("ops", "server")
    assert admin.refusal(credentials(**{"x-api-key": "ops"})) is None
    assert admin.refusal(credentials(authorization="Bearer ops")) is None
    assert admin.refusal(credentials(**{"x-api-key": "key-a"}), TENANTS).code == "admin_only"
    assert admin.refusal(credentials()).status == 401


@pytest.mark.parametrize(
    "admin, metrics, key, expected",
    [
        (None, None, None, (404, "metrics_disabled")),
        (None, None, "key-a", (404, "metrics_disabled")),
        ("ops", None, None, (401, "invalid_api_key")),
        ("ops", None, "ops", None),
        ("ops", None, "key-a", (403, "operator_only")),
        (None, "scrape", "scrape", None),
        (None, "scrape", "ops", (401, "invalid_api_key")),
        ("ops", "scrape", "scrape", None),
        ("ops", "scrape", "ops", None),
        ("ops", "scrape", "nope", (401, "invalid_api_key")),
    ],
)
def test_who_may_read_metrics_where_tenants_have_keys(admin, metrics, key, expected):
    readers = MetricsReaders(TENANTS, AdminKey(admin, "server"), metrics)
    for headers in ({"authorization": f"Bearer {key}"}, {"x-api-key": key}) if key else ({},):
        refusal = readers.refusal(credentials(**headers))
        assert (refusal and (refusal.status, refusal.code)) == (expected or None), headers
        if expected == (404, "metrics_disabled"):
            assert "--metrics-api-key" in refusal.message and "--admin-api-key" in refusal.message  # the fix
        elif expected is not None and key is None:
            assert "Authorization: Bearer" in refusal.message


def test_without_tenant_keys_metrics_stay_open():
    readers = MetricsReaders(KeyTable({}), AdminKey("ops", "server"), "scrape")
    readers.require(Headers(headers={}))  # no key, no refusal
    assert readers.refusal(credentials(authorization="Bearer anything")) is None


def test_two_different_keys_are_a_400():
    readers = MetricsReaders(TENANTS, AdminKey("ops", "server"), "scrape")
    with pytest.raises(APIError) as refused:
        readers.require(Headers(headers={"x-api-key": "scrape", "authorization": "Bearer ops"}))
    assert (refused.value.status, refused.value.code) == (400, "ambiguous_authorization")


def test_a_metrics_key_that_is_a_tenant_key_is_refused_at_start_up():
    with pytest.raises(ValueError, match=r"metrics_api_key \(--metrics-api-key\) is also a tenant key"):
        ServerSettings(api_keys={"key-a": "tenant-a"}, metrics_api_key="key-a")  # checked before the model loads
    with pytest.raises(ValueError, match="metrics API key is also a tenant key"):
        Authenticator({"key-a": "tenant-a"}, metrics_api_key="key-a")
    with pytest.raises(ValueError, match="metrics-api-key is also a tenant key"):
        RouterSettings(replicas=("http://127.0.0.1:9",), api_keys={"key-a": "tenant-a"}, metrics_api_key="key-a")
