"""A project's alerts page (`api.alerts._page`): both of its plans (walk the alerts newest
first, or sort the project's) give the page a plain filter and sort gives, for a project
with most of the alerts and for one with few, on each backend; and the counts choose the
cheap plan for each."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.api import alerts as alerts_api
from ampwatch.server.models import Alert, Project, Run

#: Every SPARSE-th alert is the small project's: 12 of 1,200.
ALERTS, SPARSE = 1200, 100


def _store(session: Session) -> dict[str, list[tuple[int, str]]]:
    """Alerts of two projects' runs, interleaved; each project's (alert id, status)."""
    session.add_all([Project(name="big"), Project(name="small")])
    runs = [Run(client_run_id=f"r{i}", name=f"r{i}", project="big") for i in range(4)]
    runs.append(Run(client_run_id="s", name="s", project="small"))
    session.add_all(runs)
    session.flush()
    alerts = []
    for i in range(ALERTS):
        run = runs[-1] if i % SPARSE == 0 else runs[i % 4]
        status = "firing" if i % 3 else "resolved"
        alerts.append(
            Alert(run_id=run.id, rule="nan_loss", layer=f"l{i}", severity="critical",
                  status=status, started_step=i, message="", values={})
        )  # fmt: skip
    session.add_all(alerts)
    session.commit()
    ids: dict[str, list[tuple[int, str]]] = {"big": [], "small": []}
    for alert in alerts:
        ids["small" if alert.run_id == runs[-1].id else "big"].append((alert.id, alert.status))
    return ids


@pytest.mark.parametrize("project", ["big", "small"])
@pytest.mark.parametrize("walk", [True, False])
def test_both_plans_give_the_same_page(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, project: str, walk: bool
) -> None:
    with sessions() as session:
        stored = sorted(_store(session)[project], reverse=True)
        monkeypatch.setattr(alerts_api, "_walks_far", lambda *_: not walk)
        for limit, offset in ((100, 0), (7, 5), (100, 1100), (1000, 0)):
            page = alerts_api._page(session, [], limit, offset, project=project)
            assert [a.id for a in page.alerts] == [i for i, _ in stored][offset : offset + limit]
            assert page.total == len(stored)
        firing = [i for i, status in stored if status == "firing"]
        page = alerts_api._page(session, [Alert.status == "firing"], 5, 0, project=project)
        assert ([a.id for a in page.alerts], page.total) == (firing[:5], len(firing))


def test_the_counts_choose_the_plan(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        ids = _store(session)
        big, small = len(ids["big"]), len(ids["small"])
        # The big project holds 99% of the alerts: a page of 100 is ~101 rows walked.
        assert not alerts_api._walks_far(session, big, 100)
        # The small one: ~10,000 rows walked for 12 sorted.
        assert alerts_api._walks_far(session, small, 100)
        assert alerts_api._walks_far(session, 0, 100)  # nothing to find: no walk at all
