module kvsnap.dev/consumer

go 1.19

require kvsnap.dev/kvsnap v0.0.0

replace kvsnap.dev/kvsnap => ../../../go
