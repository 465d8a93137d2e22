"""A dry run whose program deadlocks raises, naming each running rank's last action, instead of
waiting forever (every running stage waits for a message or a collective and nothing is posted
for a few seconds: none can send what another waits for)."""
import threading

from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import dry_run
from course_lib.virtual import priced

SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)


def test_a_lost_message_is_a_deadlock_named_not_a_hang(monkeypatch):
    post = priced.Stages.post

    def lose_the_first_gradient(self, flow, begin):
        if flow.startswith("1>0") and not getattr(self, "lost", False):   # stage 1 -> stage 0
            self.lost = True            # its receiver waits for it forever
            return
        post(self, flow, begin)

    monkeypatch.setattr(priced.Stages, "post", lose_the_first_gradient)
    raised = []

    def run():
        try:
            dry_run(SPEC, "a100-80gb", Layout(pp=2, global_batch=4), progress=None)
        except RuntimeError as e:
            raised.append(e)

    worker = threading.Thread(target=run, daemon=True)   # without the watchdog: fails, not hangs
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the dry run still waits after 60 s: a hang"
    assert raised and "deadlock" in str(raised[0]), raised
    assert "rank 0: " in str(raised[0]) and "rank 1: " in str(raised[0]), str(raised[0])


def test_a_run_that_ends_is_not_called_a_deadlock():
    r = dry_run(SPEC, "a100-80gb", Layout(pp=2, global_batch=4), progress=None)
    assert r.step_time > 0
