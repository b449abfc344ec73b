/* The C side of the binding's calls that take a batch. The batch's arrays are Go memory,
 * passed as arguments (never stored in C memory): each call builds its kvsnap_batch on the C
 * stack. */
#ifndef KVSNAP_GO_BATCH_H
#define KVSNAP_GO_BATCH_H

#include <kvsnap/kvsnap_c.h>

#define KVSNAP_GO_BATCH                                                                  \
  const kvsnap_batch batch = {.batch_size = rows, .length = length, .input_ids = ids,    \
                              .seq_offsets = offsets, .seq_query_lens = lens,           \
                              .seq_ids = seqs}
#define KVSNAP_GO_BATCH_ARGS                                                             \
  int64_t rows, int64_t length, const int32_t *ids, const int32_t *offsets,             \
      const int32_t *lens, const int32_t *seqs

#endif
