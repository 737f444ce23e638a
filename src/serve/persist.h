/* persist.h: `petrel serve --session-dir DIR`: finished requests' latent KV saved as session
 * files in DIR by a writer thread (the scheduler only takes a snapshot, petrel_session_snapshot:
 * the session's page table shared copy-on-write, and hands it over), and at start every file
 * there loaded into the engine's prefix cache, so a conversation's next turn or a repeated
 * system prompt skips its prefill across restarts. Files: DIR/<hash of the tokens, the model and the adapter set>.psess, written whole
 * or not at all; a file for another model, KV type or adapter set, or a damaged one, is skipped.
 * At most max_files are kept (the oldest removed first). */
#ifndef PETREL_SERVE_PERSIST_H
#define PETREL_SERVE_PERSIST_H
#include "petrel.h"

typedef struct persist persist;
/* Opens (creating DIR if missing), loads what DIR holds into the prefix cache (*loaded / *skipped
 * files), starts the writer. */
int persist_open(petrel_engine *e, const char *dir, int max_files, int ctx, persist **out, int *loaded, int *skipped, petrel_error *err);
/* Scheduler thread: queue s's cached positions for saving (nothing when shorter than a page or
 * the queue is full: a hint, never a wait). */
void persist_offer(persist *p, const petrel_session *s);
/* Writes what is queued, stops the writer, frees; returns the files written in all. */
long persist_close(persist *p);
/* Files written so far. */
long persist_written(const persist *p);
#endif
