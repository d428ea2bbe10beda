"""The overhead governor's decisions, driven by a simulated target whose hit rates are known."""

from __future__ import annotations

import pytest

from sampler.control.governor import DUTY, FULL, RSS, Governor


def simulate(g: Governor, seconds: float, alloc_rate, free_rate, step: float = 0.05):
    """Run a target for `seconds`: allocation hits accrue only while the governor has the
    allocation probes attached. Returns (attached seconds, interval coverages, actions)."""
    st = g.states[1]
    t = st.last_t
    a = f = 0.0
    attached = 0.0
    coverages, actions = [], []
    next_obs, next_iv = t + 1.0, t + 10.0
    while t < seconds:
        rate = alloc_rate(t) if callable(alloc_rate) else alloc_rate
        if st.level != RSS and st.on:
            a += rate * step
            attached += step
        f += (free_rate(t) if callable(free_rate) else free_rate) * step
        t = round(t + step, 6)
        if t >= next_obs:
            g.observe(1, t, (int(a), int(f)))
            next_obs += 1.0
        actions += g.tick(1, t)
        if t >= next_iv:
            cov, acts = g.interval(1, t, (int(a), int(f)))
            coverages.append(cov)
            actions += acts
            next_iv += 10.0
        st = g.states[1]
    return attached, coverages, actions


def governor() -> Governor:
    g = Governor(budget=0.03, cost_ns=1000, seed=7)
    g.add(1, 0.0)
    return g


def test_under_budget_nothing_changes():
    g = governor()
    attached, cov, actions = simulate(g, 60, 10_000, 10_000)      # 2% of a CPU
    assert g.states[1].level == FULL and not actions
    assert attached == pytest.approx(60, abs=0.1) and all(c == pytest.approx(1.0) for c in cov)


def test_over_budget_duty_cycles_allocation_probes_to_the_budget():
    g = governor()
    attached, cov, actions = simulate(g, 400, 20_000, 20_000)     # 4%: frees 2%, allocs 2%
    st = g.states[1]
    assert st.level == DUTY and st.duty == pytest.approx(0.49, abs=0.011)
    assert [a.kind for a in actions].count("duty") == 1 and "budget" in actions[0].reason
    governed = attached - 2.0                                     # the first seconds ran at full rate
    assert governed / 398 == pytest.approx(st.duty, abs=0.04)     # random phases cover the duty
    assert sum(cov[2:]) / len(cov[2:]) == pytest.approx(st.duty, abs=0.06)
    cost = (20_000 * governed + 20_000 * 398) * 1e-6 / 398        # CPU fraction the probes used
    assert cost <= 0.03 * 1.05


def test_frees_alone_over_budget_move_the_target_to_the_always_on_tier():
    g = governor()
    _, _, actions = simulate(g, 20, 100_000, 100_000)
    assert g.states[1].level == RSS
    assert [a.kind for a in actions] == ["rss"] and "always-on" in actions[0].reason


def test_load_drop_restores_full_coverage():
    g = governor()
    load = lambda t: 20_000 if t < 60 else 2_000            # noqa: E731
    _, _, actions = simulate(g, 200, load, load)
    kinds = [a.kind for a in actions]
    assert g.states[1].level == FULL and g.states[1].duty == 1.0
    assert kinds.count("duty") >= 2 and "all the time again" in [a for a in actions if a.kind == "duty"][-1].reason


def test_duty_is_rounded_down_so_the_budget_is_a_ceiling():
    g = governor()
    simulate(g, 30, 30_000, 10_000)        # (3% - 1%) / 3% = 0.666.. -> 0.66
    assert g.states[1].duty == 0.66


def test_links_of_other_targets_on_the_same_library_are_priced():
    """2% of a CPU alone; with 20 other targets' links at 35 ns each, every hit costs 1.7 us:
    3.4%, over the budget."""
    g = Governor(budget=0.03, cost_ns=1000, seed=7, link_ns=35)
    g.add(1, 0.0)
    g.sharing(1, 20)
    assert g.cost(1) == pytest.approx(1700)
    _, _, actions = simulate(g, 60, 10_000, 10_000)
    st = g.states[1]
    assert st.level == DUTY and "1.70 us" in actions[0].reason
    assert st.duty == pytest.approx((0.03 - 0.017) / 0.017, abs=0.05)
    g.sharing(1, 0)                       # the others left: the price falls back
    assert g.cost(1) == 1000
