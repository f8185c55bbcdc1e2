"""The shared fixtures keep tests apart (tests/conftest.py): what one test made on the shared
Prefect server is gone for the next, and what one made on the shared Ray goes with its job."""

from __future__ import annotations

from conftest import PREFECT_HTTP, prefect_keys, reset_prefect  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)


def test_prefect_api_gives_each_test_an_empty_server(prefect_api, shared_prefect_server):
    api, env = prefect_api
    start_state = shared_prefect_server.start_state
    assert env["PREFECT_API_URL"] == api and "prefect_client" in env["PREFECT_HOME"]  # this test's own home
    assert prefect_keys(api) == start_state  # nothing of an earlier test's
    flow = PREFECT_HTTP.post(f"{api}/flows/", json={"name": "suite-fixture-flow"}, timeout=scaled(10)).json()
    made = [
        PREFECT_HTTP.post(f"{api}/deployments/", json={"name": "d", "flow_id": flow["id"]}, timeout=scaled(10)),
        PREFECT_HTTP.post(f"{api}/flow_runs/", json={"flow_id": flow["id"], "name": "r"}, timeout=scaled(10)),
        PREFECT_HTTP.post(f"{api}/work_pools/", json={"name": "suite-fixture-pool", "type": "process"}, timeout=scaled(10)),
        PREFECT_HTTP.post(f"{api}/variables/", json={"name": "suite_fixture_var", "value": 1}, timeout=scaled(10)),
        PREFECT_HTTP.post(f"{api}/automations/", json={
            "name": "suite-fixture-automation", "trigger": {"type": "event", "expect": ["x.y"], "posture": "Reactive",
                                                            "threshold": 1, "within": 0},
            "actions": [{"type": "do-nothing"}]}, timeout=scaled(10)),
    ]
    assert all(r.ok for r in made), [r.text for r in made if not r.ok]
    assert prefect_keys(api) != start_state
    reset_prefect(api, start_state)  # what the fixture does before and after every test
    assert prefect_keys(api) == start_state


def test_ray_driver_frees_what_a_test_made_when_it_disconnects(ray_local):
    import ray

    from rlcore.controller.ray_cluster import ensure_ray
    from rlcore.controller.ray_placement import ResourcePool

    ensure_ray(address=ray_local)  # as `ray_driver` connects
    try:
        pool = ResourcePool("suite-fixture", 1, cpus_per_bundle=1.0, timeout_s=300)  # left for Ray to free
        pg_id = pool.pg.id.hex()
        assert ray.util.placement_group_table()[pg_id]["state"] == "CREATED"
    finally:
        ray.shutdown()
    ensure_ray(address=ray_local)  # the next test's connection
    try:
        assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"
    finally:
        ray.shutdown()
