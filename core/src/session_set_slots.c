/* The producer's side of sets sent again (wire.h: TSHARE_SET_AGAIN): per
 * channel, which builder's set declared the layout the peer keeps in each
 * of its TSHARE_SET_LAYOUT_SLOTS slots. A builder is named by a serial no
 * other builder of this process gets and by its generation, which every
 * change but the metadata bumps: a slot serves only the builder and
 * generation that declared it, so a builder changed, or a new one made
 * where an old one was, never goes out as another's layout. A layout the
 * peer says it lost (TSHARE_SET_DROPPED) is forgotten: that builder's next
 * set goes whole and declares it anew. */
#include "session.h"
#include "log.h"
#include "session_set.h"

#include <pthread.h>

/* The slot builder declared a layout in (any generation), else the least
 * recently used one (ch->lock held). */
static unsigned slot_for(const tshare_channel *ch, uint64_t builder) {
  unsigned pick = 0;
  for (unsigned i = 0; i < TSHARE_SET_LAYOUT_SLOTS; i++) {
    if (ch->set_layouts[i].builder == builder) return i;
    if (ch->set_layouts[i].used < ch->set_layouts[pick].used) pick = i;
  }
  return pick;
}

ts_set_again_plan ts_set_slots_plan(tshare_channel *ch, uint64_t builder, uint64_t generation, ts_keep_state state) {
  ts_set_again_plan plan = {0, 0};
  if (state == TS_KEEP_NONE || !ts_set_again_agreed(ch)) return plan;
  pthread_mutex_lock(&ch->lock);
  unsigned i = slot_for(ch, builder);
  ts_set_layout_slot *slot = &ch->set_layouts[i];
  plan.slot = i + 1;
  if (slot->builder == builder && slot->generation == generation && slot->layout_id && state == TS_KEEP_KEPT) {
    plan.layout_id = slot->layout_id;
  } else { /* offered anew: no layout here until that set went out whole */
    *slot = (ts_set_layout_slot){.builder = builder, .generation = generation};
  }
  slot->used = ++ch->set_layout_clock;
  pthread_mutex_unlock(&ch->lock);
  return plan;
}

void ts_set_slots_declared(tshare_channel *ch, unsigned slot, uint64_t builder, uint64_t generation,
                           uint64_t layout_id) {
  pthread_mutex_lock(&ch->lock);
  ts_set_layout_slot *s = &ch->set_layouts[slot - 1];
  /* A layout the peer said it lost before its set was done going out is
   * never recorded: the next set of the builder goes whole. */
  if (s->builder == builder && s->generation == generation) s->layout_id = layout_id == s->dropped ? 0 : layout_id;
  pthread_mutex_unlock(&ch->lock);
}

void ts_set_slots_dropped(tshare_channel *ch, const tshare_set_dropped_frame *d) {
  if (!ts_set_again_agreed(ch)) {
    TS_LOG(TS_LOG_WARN, "%s dropped a set layout on a channel that keeps none: ignored", ch->conn.peer_label);
    return;
  }
  pthread_mutex_lock(&ch->lock);
  ts_set_layout_slot *s = &ch->set_layouts[d->layout_slot - 1];
  bool forgotten = s->layout_id == d->layout_id;
  if (forgotten) s->layout_id = 0;
  else if (!s->layout_id) s->dropped = d->layout_id; /* the declaring set may still be going out */
  pthread_mutex_unlock(&ch->lock);
  /* Another id crossed a newer declaration in that slot: nothing to forget. */
  TS_LOG(TS_LOG_INFO, "%s dropped set layout %llu from slot %u%s", ch->conn.peer_label,
         (unsigned long long)d->layout_id, (unsigned)d->layout_slot, forgotten ? ": its builder goes whole next" : "");
}
