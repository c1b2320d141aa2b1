python3 -c from\ op_builder\ import\ CometBuilder\;\ CometBuilder\(\).load\(verbose=False\)\;\ print\(\'ds_comet\ op\ ready\'\) 
