"""Notebook 09's questions: the second on the exported script before the notebook deletes it; the
first at the end, on a cluster of 4 engines of its own (the notebook's clusters have stopped by then)."""
# %% before: shutil.rmtree(os.path.splitext(script)[0] + "_state"
source = open(script).read()                # PLAN = Plan(**{...}) as exported, then fsdp=2 in place of tp=2
with open(script, "w") as f:
    f.write(source.replace("\nSTEPS = ", "\nPLAN = PLAN.replace(tp=1, fsdp=2)\nSTEPS = "))
again = subprocess.run([str(torchrun), "--nproc_per_node", "2", script], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
print(again.stdout[-1000:])
# %%
fsdp_job = [float(x) for x in re.findall(r"loss ([0-9.]+)", again.stdout)]
assert again.returncode == 0, again.stderr[-3000:]
expect(len(fsdp_job) == 5 and max(abs(a - b) for a, b in zip(fsdp_job, session_next)) < 1e-4,
       "Q2: under fsdp=2 the exported script resumes with the same 5 losses", seen=fsdp_job)
# %%
from interactive_parallel import PlanError

bigger = ipp.Cluster(n=4, engines=ZYGOTE_ENGINES, profile_dir=tempfile.mkdtemp(prefix="ip-profile-"),
                     controller_args=["--HeartMonitor.period=200"], log_level=40)
bigger.start_and_connect_sync()
with Session.attach(cluster_id=bigger.cluster_id, profile_dir=bigger.profile_dir, ranks=4) as four:
    four.load_model("tiny-llama")
    runs = {}
    for candidate in (Plan(tp=2), Plan(fsdp=2), Plan(dp=2, tp=2), Plan(pp=2, fsdp=2), Plan(fsdp=4), Plan(tp=4)):
        try:
            runs[candidate.describe()] = bool(four.check_plan(candidate))
        except PlanError:
            runs[candidate.describe()] = False
    four.apply(Plan(dp=2, tp=2, batch_size=8, seq_len=64, lr=3e-3))
    four_ran = four.train(steps=1)
bigger.stop_cluster_sync()
shutil.rmtree(bigger.profile_dir, ignore_errors=True)
print(runs)
# %%
expect(runs == {"tp2": False, "fsdp2": False, "dp2xtp2": True, "pp2xfsdp2": True, "fsdp4": True, "tp4": True}
       and len(four_ran) == 4,
       "Q1: on 4 engines the plans of 4 ranks run (dp=2 x tp=2, pp=2 x fsdp=2, fsdp=4, tp=4); "
       "a plan of 2 ranks no longer matches the world", seen=runs)
