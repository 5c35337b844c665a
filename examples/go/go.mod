module github.com/redbatch/examples/go

go 1.19

require (
	github.com/gomodule/redigo v1.8.3
	github.com/vmihailenco/msgpack/v5 v5.3.5
)

require github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
