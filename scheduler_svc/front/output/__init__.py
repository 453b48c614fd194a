"""A request's updates made into what its client reads: detokenized deltas, mailboxes, streams, statuses."""
