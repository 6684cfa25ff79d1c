"""Notebook 09's questions: the second on the exported script before the notebook deletes it; the
first at the end, on a cluster of 2 engines of its own (the notebook's clusters have stopped by then)."""
# %% before: shutil.rmtree(os.path.splitext(script)[0] + "_state"
source = open(script).read()                # PLAN = Plan(**{...}) as exported, then fsdp=4 in place of dp=2 x tp=2
with open(script, "w") as f:
    f.write(source.replace("\nSTEPS = ", "\nPLAN = PLAN.replace(dp=1, tp=1, fsdp=4)\nSTEPS = "))
again = subprocess.run([str(torchrun), "--nproc_per_node", "4", script], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
print(again.stdout[-1000:])
# %%
fsdp_job = [float(x) for x in re.findall(r"loss ([0-9.]+)", again.stdout)]
assert again.returncode == 0, again.stderr[-3000:]
expect(len(fsdp_job) == 5 and max(abs(a - b) for a, b in zip(fsdp_job, session_next)) < 1e-4,
       "Q2: under fsdp=4 the exported script resumes with the same 5 losses", seen=fsdp_job)
# %%
from interactive_parallel import PlanError

small = ipp.Cluster(n=2, engines=ZYGOTE_ENGINES, profile_dir=tempfile.mkdtemp(prefix="ip-profile-"),
                    controller_args=["--HeartMonitor.period=200"], log_level=40)
small.start_and_connect_sync()
with Session.attach(cluster_id=small.cluster_id, profile_dir=small.profile_dir, ranks=2) as two:
    two.load_model("tiny-llama")
    still = {}
    for candidate in (Plan(dp=2), Plan(fsdp=2), Plan(tp=2), Plan(pp=2), Plan(cp=2), Plan(dp=2, tp=2)):
        try:
            still[candidate.describe()] = bool(two.check_plan(candidate))
        except PlanError:
            still[candidate.describe()] = False
    two.apply(Plan(tp=2, batch_size=8, seq_len=64, lr=3e-3))
    two_ran = two.train(steps=1)
small.stop_cluster_sync()
shutil.rmtree(small.profile_dir, ignore_errors=True)
print(still)
# %%
expect(still == {"dp2": True, "fsdp2": True, "tp2": True, "pp2": True, "cp2": True, "dp2xtp2": False} and two_ran,
       "Q1: on 2 engines, every plan of one axis of 2 still runs; dp=2 x tp=2 needs 4 ranks", seen=still)
