"""``nbgrader collect`` that takes a submission only from the learner it names, and never from the future.

Teaches what nbgrader's exchange trusts and what a class on one server must check. A learner
submits by writing ``inbound/<student>+<assignment>+<timestamp>+<random>`` into the shared
exchange; ``collect`` reads the student and the time from that NAME. nbgrader's own collect
compares the file's owner with the student it names but only logs "cheating attempt?" and
collects it anyway, and it keeps the newest timestamp: a file named for another learner, dated
next year, would be collected as theirs and win over every real resubmission of theirs.

:class:`OwnedCollect` (the class's course config selects it through nbgrader's
``ExchangeFactory.collect``) drops, before nbgrader picks the newest of each learner:

- a submission whose owner (the Unix account that wrote it) is not the learner it names;
- a submission dated later than now (a minute's leeway for clocks).

Each refusal is an ERROR line in collect's output, naming the file, whom it claims and who
wrote it, so the instructor sees who tried; the other learners' submissions are collected.

Leaves out: the one-account class (``--trusted-class``), where every file has the one owner and
this check cannot tell learners apart: it is not selected there.
References: nbgrader's exchange (nbgrader/exchange/default/collect.py) and its docs on the
exchange's file names; stat(2).
"""
from __future__ import annotations

import datetime
import glob
import os
import pwd
from collections import defaultdict

from nbgrader.exchange.default.collect import ExchangeCollect

LEEWAY = datetime.timedelta(minutes=1)


def owner_of(path: str) -> str:
    uid = os.stat(path).st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


class OwnedCollect(ExchangeCollect):
    """nbgrader's collect, refusing impersonated and future-dated submissions."""

    def init_src(self):
        super().init_src()
        # init_src kept each learner's newest record: choose again among the honest ones only
        student = self.coursedir.student_id or "*"  # nbgrader's default: every student
        pattern = os.path.join(self.inbound_path, f"{student}+{self.coursedir.assignment_id}+*")
        honest, now = defaultdict(list), datetime.datetime.now(datetime.timezone.utc)
        for path in sorted(glob.glob(pattern)):
            record = self._path_to_record(path)
            why = refusal(path, record, now)
            if why:
                self.log.error("REFUSED %s: %s", record["filename"], why)
            else:
                honest[record["username"]].append(record)
        self.src_records = [newest(records, self.duedate if self.before_duedate else None)
                            for records in honest.values()]


def newest(records: list[dict], duedate) -> dict:
    """The newest record, or with a due date the newest before it if there is one (nbgrader's rule)."""
    records = sorted(records, key=lambda r: r["timestamp"], reverse=True)
    if duedate is not None:
        return next((r for r in records if r["timestamp"] <= duedate), records[0])
    return records[0]


def refusal(path: str, record: dict, now: datetime.datetime) -> str | None:
    """Why a submission is refused, in words; None when it is its learner's own and not future-dated."""
    owner = owner_of(path)
    if owner != record["username"]:
        return (f"it claims to be {record['username']}'s but was written by {owner}: not collected "
                f"(a submission is collected only from the account it names)")
    stamp = record["timestamp"]
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    if stamp > now + LEEWAY:
        return (f"it is dated {stamp:%Y-%m-%d %H:%M:%S} UTC, later than now: not collected "
                "(a future date would win over every real resubmission)")
    return None
