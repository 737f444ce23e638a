/* plan.c: memory budget arithmetic for the expert store.
 * Invariant: a plan that is returned fits: resident + kv + scratch + n_layers * slots *
 * slot_bytes <= budget (when a budget is given), and min_slots <= slots <= n_experts.
 * Everything is computed in uint64 with overflow checks; refusals say what is short by how much. */
#include <stdio.h>
#include <string.h>

#include "base/err.h"
#include "experts/xs.h"

static double gib(uint64_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

int xs_plan_make(const xs_plan_in *in, xs_plan *out, petrel_error *err) {
    memset(out, 0, sizeof *out);
    if (!in || in->n_layers <= 0 || in->n_experts <= 0 || in->record_bytes == 0)
        return pt_err(err, PETREL_EINVAL, "expert plan: need n_layers, n_experts and record_bytes > 0");
    if (in->expert_slots < 0) return pt_err(err, PETREL_EINVAL, "expert plan: expert_slots %d < 0", in->expert_slots);
    out->in = *in;
    int min_slots = in->min_slots > 0 ? in->min_slots : 1;
    if (min_slots > in->n_experts) min_slots = in->n_experts;
    uint64_t slot = (in->record_bytes + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN;
    out->slot_bytes = slot;
    uint64_t fixed = in->resident_bytes + in->kv_bytes;
    if (fixed < in->resident_bytes || fixed + in->scratch_bytes < fixed)
        return pt_err(err, PETREL_EINVAL, "expert plan: byte counts overflow");
    fixed += in->scratch_bytes;
    uint64_t per_slot_all_layers = slot * (uint64_t)in->n_layers; /* one slot in every layer */
    int slots;
    if (in->budget) {
        if (fixed > in->budget)
            return pt_err(err, PETREL_ENOMEM,
                          "memory budget %.2f GiB cannot be met: resident weights %.2f GiB + KV %.2f GiB + "
                          "scratch %.2f GiB already need %.2f GiB before any expert slot",
                          gib(in->budget), gib(in->resident_bytes), gib(in->kv_bytes), gib(in->scratch_bytes),
                          gib(fixed));
        uint64_t room = (in->budget - fixed) / per_slot_all_layers;
        if (in->expert_slots) {
            if ((uint64_t)in->expert_slots > room)
                return pt_err(err, PETREL_ENOMEM,
                              "memory budget %.2f GiB cannot hold %d expert slots per layer (%d layers x %.1f MiB "
                              "each = %.2f GiB on top of %.2f GiB); at most %llu fit",
                              gib(in->budget), in->expert_slots, in->n_layers, slot / 1048576.0,
                              gib(per_slot_all_layers * (uint64_t)in->expert_slots), gib(fixed),
                              (unsigned long long)room);
            slots = in->expert_slots;
        } else {
            slots = room > (uint64_t)in->n_experts ? in->n_experts : (int)room;
        }
        if (slots < min_slots)
            return pt_err(err, PETREL_ENOMEM,
                          "memory budget %.2f GiB cannot be met: after %.2f GiB resident+KV+scratch only %d expert "
                          "slot(s) per layer fit (%.1f MiB each, %d layers), need at least %d; raise the budget by "
                          "%.2f GiB",
                          gib(in->budget), gib(fixed), slots, slot / 1048576.0, in->n_layers, min_slots,
                          gib(per_slot_all_layers * (uint64_t)min_slots - (in->budget - fixed) + 1));
    } else {
        slots = in->expert_slots ? in->expert_slots : in->n_experts;
        if (slots < min_slots)
            return pt_err(err, PETREL_EINVAL, "expert_slots %d is below the %d the layer needs", slots, min_slots);
    }
    if (slots > in->n_experts) slots = in->n_experts;
    out->slots_per_layer = slots;
    out->expert_bytes = per_slot_all_layers * (uint64_t)slots;
    out->total_bytes = fixed + out->expert_bytes;
    out->all_resident = slots == in->n_experts;
    return 0;
}

int xs_plan_format(const xs_plan *p, char *buf, size_t n) {
    const xs_plan_in *in = &p->in;
    int w = snprintf(buf, n,
                     "resident weights  %9.2f GiB\n"
                     "KV cache          %9.2f GiB\n"
                     "scratch           %9.2f GiB\n"
                     "expert slots      %9.2f GiB  (%d layers x %d of %d slots x %.2f MiB%s)\n"
                     "total             %9.2f GiB  of budget %s",
                     gib(in->resident_bytes), gib(in->kv_bytes), gib(in->scratch_bytes), gib(p->expert_bytes),
                     in->n_layers, p->slots_per_layer, in->n_experts, p->slot_bytes / 1048576.0,
                     p->all_resident ? ", all resident" : "", gib(p->total_bytes), in->budget ? "" : "unlimited");
    if (in->budget && w >= 0 && (size_t)w < n) w += snprintf(buf + w, n - (size_t)w, "%.2f GiB", gib(in->budget));
    return w;
}
