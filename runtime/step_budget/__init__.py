"""The step budget: how many prefill tokens each step may take so a step's time stays near an
inter-token target (docs/design.md §5.6, §6).

    budgets.py          the StepBudget interface (the scheduler's one view of this package), the
                        fixed / latency-target / relative-target budgets and the one factory
    cost_model.py       StepCostModel: a step's predicted time from its shape, fitted by calibration
    expert_reads.py     ExpertRouting: the distinct experts a mixture-of-experts step is expected to read
    time_correction.py  the measured/predicted ratio learned while serving
    calibration.py      timing steps of known shape on an engine and fitting the cost model (torch:
                        imported only by what runs an engine, never by the scheduling side)
    idle_calibration.py the same points timed one step per idle turn of a serving engine
    cost_model_cache.py the fits this machine measured, by what step time depends on
    serving_cost_model.py which model a loaded engine starts with (engine.json, stored, pending)
"""
